"""The two-dimensional window (row_context): reduction to raster Jacobi decoding, the row-causal
mask, per-row progress, batch independence, and clear refusals."""

import pytest
import torch

import speculaas as sp

COLS = 5  # the tiny fixture's grid is 3 x 5


@pytest.mark.parametrize("method,opts", [("sjd", {}), ("csd", {"delta": 0.65}), ("gsd", {})])
@pytest.mark.parametrize("coupling,draft_init", [("maximal", "vertical"), ("none", "uniform"),
                                                 ("gumbel", "vertical_sample")])
@pytest.mark.parametrize("window", [3, 16])
def test_a_full_row_of_context_is_raster_jacobi(tiny, method, opts, coupling, draft_init,
                                                 window):
    """c = a full row: no row starts before the one above is complete, so the same seed gives
    the same tokens and the same forward passes as the one-dimensional loop."""
    kw = dict(method=method, seed=[4, 5, 6], cfg_scale=2.0, window=window, coupling=coupling,
              draft_init=draft_init, decode_images=False, **opts)
    raster = sp.generate(tiny, [3, None, 7], **kw)
    rows = sp.generate(tiny, [3, None, 7], row_context=COLS, **kw)
    assert torch.equal(rows.tokens, raster.tokens)
    assert torch.equal(rows.forward_passes, raster.forward_passes)


@pytest.mark.parametrize("method", ["sjd", "csd"])
def test_greedy_with_full_rows_equals_greedy_ar(tiny, method):
    ar = sp.generate(tiny, [3, None, 7], method="ar", top_k=1, cfg_scale=2.0)
    out = sp.generate(tiny, [3, None, 7], method=method, top_k=1, cfg_scale=2.0, seed=1,
                      row_context=COLS)
    assert torch.equal(out.tokens, ar.tokens)


def test_rows_run_side_by_side_and_never_pass_the_row_above(tiny):
    out = sp.generate(tiny, [3, None, 7, 1], method="sjd", seed=2, row_context=1,
                      decode_images=False)
    step = out.commit_step  # [B, rows, cols]
    assert (step[:, 1:] >= step[:, :-1]).all()  # a token comes after the one above it
    # The diagonal frontier: some row starts before the row above is finished.
    assert (step[:, 1:, 0] < step[:, :-1, -1]).any()
    raster = sp.generate(tiny, [3, None, 7, 1], method="sjd", seed=2, decode_images=False)
    assert out.forward_passes.sum() < raster.forward_passes.sum()


def _packed(session, inputs, pos, seg, store, cached, length, causal_across=False):
    """One packed forward; visible = cached keys before each segment's anchor position."""
    pos, seg = torch.tensor([pos]), torch.tensor([seg])
    k = torch.zeros_like(seg)
    for s in range(1, seg.shape[1]):
        k[0, s] = k[0, s - 1] + 1 if seg[0, s] == seg[0, s - 1] else 0
    anchor = pos - k
    gen = torch.arange(-1, length - 1)
    visible = torch.isin(gen, torch.tensor(cached))[None, None] & (gen < anchor[..., None])
    if causal_across:  # negative control: a plain causal mask over all slots
        window = pos[:, None, :] <= pos[:, :, None]
    else:
        window = (seg[:, :, None] == seg[:, None, :]) & (k[:, None, :] <= k[:, :, None])
    cond, _ = session.forward_packed(torch.tensor([inputs]), pos, torch.tensor([0]), visible,
                                     window, torch.tensor([store]))
    return cond[0]


def test_row_causal_mask_hides_other_rows_drafts(tiny):
    """Row 0 drafts positions 3, 4 behind its anchor at 2; row 1 drafts 5, 6 behind a stand-in
    anchor. Changing one row's drafts leaves the other row's target logits exactly as they
    were; with a plain causal mask (the negative control) it does not."""
    length = tiny.layout.length
    session = tiny.start([3], cfg=False)
    _packed(session, [0, 1, 2], [-1, 0, 1], [0, 0, 0], [True] * 3, [], length)  # commit 0, 1
    pos, seg, store = [2, 3, 4, 4, 5, 6], [0, 0, 0, 1, 1, 1], [True, True, True, False, True, True]
    cached = [-1, 0, 1]

    def run(row0, row1, **kw):
        return _packed(session, [7, *row0, 2, *row1], pos, seg, store, cached, length, **kw)

    base = run([3, 4], [5, 6])
    other0 = run([9, 10], [5, 6])
    other1 = run([3, 4], [11, 8])
    assert torch.equal(other0[3:], base[3:])  # row 1 does not see row 0's drafts
    assert torch.equal(other1[:3], base[:3])  # row 0 does not see row 1's drafts
    assert not torch.allclose(other0[1:3], base[1:3])  # ... but does see its own
    assert not torch.allclose(other1[4:], base[4:])
    control = run([3, 4], [5, 6], causal_across=True)
    control0 = run([9, 10], [5, 6], causal_across=True)
    assert not torch.allclose(control0[3:], control[3:])


def test_batch_independence_and_per_image_progress(tiny):
    prompts, seeds = [3, None, 7, 1], [11, 12, 13, 14]
    batch = sp.generate(tiny, prompts, method="csd", seed=seeds, row_context=2,
                        decode_images=False)
    for i, (p, s) in enumerate(zip(prompts, seeds, strict=True)):
        alone = sp.generate(tiny, [p], method="csd", seed=s, row_context=2, decode_images=False)
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        assert batch.forward_passes[i] == alone.forward_passes[0]
    assert len(set(batch.forward_passes.tolist())) > 1  # each image stops on its own
    assert (batch.commit_step >= 0).all()  # every position committed exactly once


def test_progress_counts_every_token(tiny):
    class Count:
        n = 0

        def update(self, k):
            Count.n += k

        def close(self):
            pass

    sp.generate(tiny, [3, 4], method="sjd", row_context=2, progress=Count(), decode_images=False)
    assert Count.n == 2 * tiny.layout.length


@pytest.mark.parametrize("kw,message", [
    ({"row_context": 0}, "row_context must be an integer >= 1"),
    ({"row_context": 6}, r"row_context must be an integer in \[1, 5\]"),
    ({"row_context": 2.0}, "row_context must be an integer"),
    ({"row_context": 2, "method": "ar"}, "needs a speculative method"),
    ({"row_context": 2, "window": "auto"}, "fixed integer window"),
    ({"row_context": 2, "advance": "batch_min"}, "batch_min"),
])
def test_bad_row_context(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        sp.generate(tiny, [3], **{"method": "sjd", **kw})


def test_models_that_cannot_take_the_mask_are_refused():
    with pytest.raises(ValueError, match="forces end-of-row tokens"):
        sp.generate(sp.load_model("tiny", row_end=True), [1], method="sjd", row_context=2)
    with pytest.raises(ValueError, match="cannot feed several rows"):
        sp.generate(sp.load_model("toy", rows=2), [None], method="sjd", row_context=1)
