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


def test_every_target_of_a_two_dimensional_decode_sees_exactly_the_committed_context():
    """Replay every packed forward of a row_context < cols decode and recompute each slot's
    logits from scratch: the prompt, the committed tokens before the segment's anchor whose
    keys were fed since they were committed, and the segment's own earlier slots. With one
    layer a key depends only on its token and position, so the reference is one plain causal
    forward over exactly that list. Fails if a lower row sees the row above's drafts, or if a
    stand-in anchor's key (written aside) is taken for the key of its position."""
    model = sp.load_model("tiny", vocab_size=12, grid=(4, 6), seed=3, n_layers=1)
    calls = []
    real_start = model.start

    def start(prompts, cfg):  # noqa: ANN001, ANN202
        session = real_start(prompts, cfg=cfg)
        packed = session.forward_packed

        def recorded(inputs, pos, images, visible, window_mask, store):  # noqa: ANN001, ANN202
            cond, uncond = packed(inputs, pos, images, visible, window_mask, store)
            calls.append((inputs[0].clone(), pos[0].clone(), window_mask[0].clone(),
                          store[0].clone(), cond[0].clone()))
            return cond, uncond

        session.forward_packed = recorded
        return session

    model.start = start
    out = sp.generate(model, [5], method="sjd", seed=1, window=4, row_context=2,
                      decode_images=False)
    model.start = real_start
    tokens, step = out.tokens[0].flatten(), out.commit_step[0].flatten()
    fed = []  # per call: {position: token} of the keys it stored
    for inputs, pos, _, store, _ in calls:
        fed.append({int(p): int(t) for p, t, s in zip(pos, inputs, store, strict=True) if s})
    side_by_side = stand_ins = 0
    for i, (inputs, pos, window_mask, _, cond) in enumerate(calls):
        starts = [s for s in range(len(pos)) if window_mask[s].any()
                  and window_mask[s].nonzero()[0, 0] == s]
        side_by_side += len(starts) > 1
        for s in range(len(pos)):
            own = window_mask[s].nonzero().flatten().tolist()
            if not own:
                continue  # padding
            anchor = int(pos[own[0]])
            stand_ins += s == own[0] and anchor >= 0 and (step[anchor] < 0 or step[anchor] >= i)
            # Position -1 is the prompt's last token (fed by the first window).
            context = [-1] if anchor > -1 and any(-1 in f for f in fed[:i]) else []
            context += [g for g in range(max(anchor, 0))
                        if 0 <= step[g] < i and any(fed[c].get(g) == int(tokens[g])
                                                    for c in range(int(step[g]), i))]
            ref_tokens = [int(tokens[g]) for g in context] + [int(inputs[o]) for o in own]
            ref_pos = context + [int(pos[o]) for o in own]
            n = len(ref_pos)
            fresh = real_start([5], cfg=False)
            ref, _ = fresh.forward_packed(
                torch.tensor([ref_tokens]), torch.tensor([ref_pos]), torch.tensor([0]),
                torch.zeros(1, n, model.layout.length, dtype=torch.bool),
                torch.ones(n, n, dtype=torch.bool).tril()[None],
                torch.ones(1, n, dtype=torch.bool))  # a fresh cache: every key at its position
            assert torch.allclose(cond[s], ref[0, -1], atol=1e-5), (i, s, anchor)
    assert side_by_side > 2 and stand_ins > 0  # lower rows really ran, some behind stand-ins


def test_unconditional_rows_read_their_own_last_prompt_token(tiny):
    # An unconditional prompt that ends in another token than the conditional one: the raster
    # forward must feed each half its own (the packed forward always did).
    session = tiny.start([1, 2], cfg=True)
    window, at, images = torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 4]), torch.arange(2)
    cond, uncond = session.forward(window.clone(), at, images)
    session.last_prompt[2:] = (session.last_prompt[2:] + 1) % 12
    cond2, uncond2 = session.forward(window.clone(), at, images)
    assert torch.equal(cond, cond2) and torch.equal(uncond[1], uncond2[1])  # offset 4: no anchor
    assert not torch.allclose(uncond[0], uncond2[0])
