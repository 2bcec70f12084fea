"""The shipped built-in model: renderer, weights, judge, and exactness of greedy SJD."""

import numpy as np
import pytest
import torch

import speculaas as sp
from speculaas.models.builtin.judge import predict, scene_labels
from speculaas.models.builtin.scenes import render_scene, sample_scenes, tokenize_caption

CAPTION = "a big red circle on the left over grass"


@pytest.fixture(scope="module")
def builtin():
    return sp.load_model("builtin")


def test_renderer_is_deterministic():
    a, b, c = render_scene(123), render_scene(123), render_scene(124)
    assert np.array_equal(a.image, b.image) and a.caption == b.caption
    assert a.image.shape == (64, 64, 3) and a.image.dtype == np.uint8
    assert not np.array_equal(a.image, c.image)


def test_caption_tokens():
    ids = tokenize_caption(CAPTION)
    assert len(ids) == 25 and ids != tokenize_caption(None)
    with pytest.raises(ValueError, match="does not know"):
        tokenize_caption("a red dragon")


def test_weights_load_and_generate_shapes(builtin):
    assert builtin.vocab_size == 4096 and builtin.grid == (16, 16)
    out = sp.generate(builtin, [CAPTION, None], method="csd", seed=0)
    assert out.tokens.shape == (2, 256) and out.commit_step.shape == (2, 16, 16)
    assert [im.size for im in out.images] == [(64, 64), (64, 64)]
    assert (out.forward_passes < 256).all()
    assert builtin.codebook().shape == (4096, 8)
    assert builtin.token_embeddings().shape[0] == 4096


def test_greedy_sjd_and_csd_equal_greedy_ar(builtin):
    ar = sp.generate(builtin, [CAPTION], method="ar", top_k=1, decode_images=False)
    for method in ("sjd", "csd"):
        out = sp.generate(builtin, [CAPTION], method=method, top_k=1, seed=1, window=16,
                          decode_images=False)
        assert torch.equal(out.tokens, ar.tokens), method
        assert out.forward_passes[0] < 256


def test_judge_reads_rendered_scenes_far_above_chance(builtin):
    scenes = sample_scenes(200, seed=77_000_000)
    pred = predict(builtin.judge, [s.image for s in scenes])
    labels = scene_labels(scenes)
    chance = {"shape": 1 / 4, "colour": 1 / 6, "background": 1 / 6, "position": 1 / 3}
    for k, c in chance.items():
        acc = (pred[k] == labels[k]).float().mean().item()
        assert acc > max(0.8, 2.5 * c), (k, acc)


def test_tokenizer_reconstructs_scenes(builtin):
    from speculaas.models.builtin import vq as vqlib

    images = np.stack([s.image for s in sample_scenes(16, seed=78_000_000)])
    recon = vqlib.decode(builtin.vq, vqlib.encode(builtin.vq, images))
    mse = ((recon.astype(np.float64) - images) ** 2).mean()
    psnr = 10 * np.log10(255**2 / mse)
    assert psnr > 20, psnr


# Forward passes of fixed (caption, seed) decodes on the shipped weights, recorded when they
# were shipped. A loop that drafts worse (say, recycles drafts one slot late) stays lossless and
# passes every exactness test, but spends more forwards: only a count catches it. The margin
# absorbs float differences between CPUs; the bug above costs about a third more.
# sjd runs Gumbel verification (its coupling is moot there); "ratio" is the classic test. A
# different random stream moves these counts by up to ~10 % for three images: re-recorded when
# the noise key became each stream's first draw (means over 8 seeds unchanged).
RECORDED = {("sjd", "none", "uniform"): 288, ("sjd", "maximal", "vertical"): 262,
            ("sjd/ratio", "maximal", "vertical"): 296,
            ("csd", "none", "uniform"): 278, ("csd", "maximal", "vertical"): 246}
REGRESSION_CAPTIONS = ["a big red circle on the left over grass",
                       "a small blue square on the right at sunset",
                       "a big white diamond on the center in front of a brick wall"]


@pytest.mark.parametrize("method,coupling,draft_init", list(RECORDED))
def test_forward_passes_stay_at_or_below_recorded(builtin, method, coupling, draft_init):
    name, _, verify = method.partition("/")
    out = sp.generate(builtin, REGRESSION_CAPTIONS, method=name, coupling=coupling,
                      draft_init=draft_init, window=16, seed=0, decode_images=False,
                      verify=verify or "gumbel")
    assert int(out.forward_passes.sum()) <= 1.03 * RECORDED[(method, coupling, draft_init)]
