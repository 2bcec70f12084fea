"""Sample-exact lossless decoding: under Gumbel verification an exact rule commits, at every
position, the token plain AR samples there from the same noise, so sjd draws the very tokens ar
draws for the same seed at any window, batch, chunking, drafting or window policy
(decoding/verify.py). The adapters' own files run the same check on the tiny real-architecture
models (assert_same_as_ar in conftest.py)."""

import pytest
import torch
from conftest import ZERO_RELAXATION, assert_same_as_ar

import speculaas as sp
from speculaas.config import DRAFT_INITS

BUILTIN_CAPTIONS = ["a big red circle on the left over grass",
                    "a small blue square on the right at sunset",
                    "a big white diamond on the center in front of a brick wall"]


@pytest.mark.parametrize("sampling", [{}, {"cfg_scale": 2.0, "top_k": 5},
                                      {"temperature": 0.7, "top_p": 0.9}])
def test_tiny_every_window_and_batch(tiny, sampling):
    prompts = [3, None, 7, 1, 5, 2, 0, 9]
    for batch in (1, 3, 8):
        assert_same_as_ar(tiny, prompts[:batch], windows=(1, 2, 16, 64, 256, "auto"), seed=batch,
                          **sampling)


def test_builtin_every_window_batch_and_chunking(builtin):
    # Window 64 on the built-in model runs in test_tree (with a tree); every window up to the
    # whole image on the tiny model above.
    assert_same_as_ar(builtin, BUILTIN_CAPTIONS, windows=(16, "auto"), seed=11)
    captions = BUILTIN_CAPTIONS * 2 + BUILTIN_CAPTIONS[:1]  # 7: chunks of 2 leave one alone
    ar = sp.generate(builtin, captions, method="ar", seed=4, decode_images=False)
    for kw in ({"window": "auto", "max_batch": 2}, {"window": 16}):
        out = sp.generate(builtin, captions, method="sjd", seed=4, decode_images=False, **kw)
        assert torch.equal(out.tokens, ar.tokens), kw


@pytest.mark.parametrize("draft_init", DRAFT_INITS)
def test_every_drafter_and_lock_step(tiny, draft_init):
    prompts = [3, None, 7]
    for advance in ("per_image", "batch_min"):
        assert_same_as_ar(tiny, prompts, windows=(4, 16), seed=5, draft_init=draft_init,
                          advance=advance, cfg_scale=1.5)


@pytest.mark.parametrize("method,options", ZERO_RELAXATION + [("gsd", {"group_size": 1}),
                                                              ("lantern", {"delta": 0.0})])
def test_relaxed_rules_at_zero_relaxation(tiny, method, options):
    assert tiny.codebook() is not None or method != "lantern"
    assert_same_as_ar(tiny, [3, None], windows=(16,), seed=2, method=method, **options)


def test_two_dimensional_window_over_full_rows_is_raster(tiny):
    cols = tiny.layout.grid[1]
    assert_same_as_ar(tiny, [3, None, 7], windows=(6,), seed=8, row_context=cols)


def test_the_check_can_fail(tiny):
    """Negative controls of the equality itself: the classic ratio test is exact only in
    distribution, and a relaxed rule changes the law; both draw other tokens than AR."""
    prompts = [3, None, 7, 1]
    ar = sp.generate(tiny, prompts, method="ar", seed=0, decode_images=False)
    for kw in ({"method": "sjd", "verify": "ratio"}, {"method": "csd", "lam": 2.0, "delta": 1.0}):
        out = sp.generate(tiny, prompts, window=16, seed=0, decode_images=False, **kw)
        assert not torch.equal(out.tokens, ar.tokens), kw
