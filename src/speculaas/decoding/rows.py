"""Two-dimensional Jacobi decoding: several image rows in flight at once (`row_context=c`).

An image token depends mostly on its neighbourhood, so row r + 1 need not wait for row r to
finish: it becomes active once row r has `c` committed tokens and then runs one window of its
own behind it, never passing the row above (its window ends at the column row r has reached).
One forward per iteration feeds every active row of every image; the window of each row is a
*segment* [anchor, draft_0 .. draft_{K-1}] of the packed input.

Row-causal attention: a segment's slots see every committed token whose key is in the cache and
earlier slots of their own segment, never another row's drafts. Committed tokens are no longer a
raster prefix, so the cache is addressed by position with a validity set: the keys of the
anchors and of the accepted drafts fed this iteration join it; a committed token nobody fed yet
(a row's last resampled token) is fed as an anchor, by its own row's next segment or by a
one-slot *flush* segment once the row has nothing more to draft.

Verification is per segment with the chosen rule and coupling (the same `verify_window` as the
one-dimensional loop). The top active row resamples from the residual at its first rejection
and always advances; lower rows keep their accepted prefix (plus the bonus token when every
draft passed) and defer the rest: the rejected slot becomes the coupling's next draft. The top
row's window runs on past its row end into rows that are not active yet, so with c = a full
row nothing ever runs beside it and the loop is one-dimensional Jacobi decoding (same tokens
for the same seed).

What this costs in exactness: a lower row's token is decided on a partial context (the right
end of the rows above is missing), so no rule stays lossless; a new row's first window is opened
by a stand-in anchor (the last committed token of the row above, at the position before the
row), as PJD does for LlamaGen. The acceptance maps show the diagonal frontier.
"""

from __future__ import annotations

import torch

from ..acceptance.base import AcceptanceRule
from ..config import JacobiConfig, SamplingConfig
from ..models.base import ImageModel, Session
from ..sampling import target_probs
from .drafting import COUPLINGS, FRESH_INITS, FreshSlots
from .jacobi import verify_window
from .window import WindowPolicy
from .result import Commits, DecodeResult, draw_ragged


def check_row_context(model: ImageModel, jacobi: JacobiConfig, speculative: bool,
                      policy: WindowPolicy | None = None) -> None:
    """Raise ValueError if `row_context` cannot run with this model and these options
    (`policy`: a window policy object given in place of a window size)."""
    c = jacobi.row_context
    if c is None:
        return
    cols = model.layout.grid[1]
    if not 1 <= c <= cols:
        raise ValueError(f"row_context must be an integer in [1, {cols}] (a row of "
                         f"{model.name} has {cols} tokens) or None, got {c!r}")
    if not speculative:
        raise ValueError("row_context needs a speculative method; ar decodes one token at a "
                         "time in raster order")
    if bool((model.layout.forced >= 0).any()):
        raise ValueError(f"row_context needs a raster token layout; {model.name} forces "
                         "end-of-row tokens between rows")
    if not model.packed_forward:
        raise ValueError(f"row_context: the {model.name} adapter cannot feed several rows with "
                         "a row-causal mask in one forward (builtin, tiny and llamagen can)")
    if not isinstance(jacobi.window, int) or (policy is not None
                                              and type(policy) is not WindowPolicy):
        raise ValueError("row_context needs a fixed integer window (each active row gets one); "
                         f"got window={policy if policy is not None else jacobi.window!r}")
    if jacobi.advance != "per_image":
        raise ValueError("row_context advances each row on its own; advance='batch_min' does "
                         "not apply")


@torch.inference_mode()
def row_jacobi_decode(
    model: ImageModel,
    session: Session,
    rule: AcceptanceRule,
    sampling: SamplingConfig,
    jacobi: JacobiConfig,
    generators: list[torch.Generator],
    progress=None,  # noqa: ANN001
    profile: bool = False,
) -> DecodeResult:
    batch, length = session.batch_size, model.layout.length
    n_rows, cols = model.layout.grid
    window, ctx = int(jacobi.window), int(jacobi.row_context)
    vocab, dev = model.vocab_size, model.device
    per = 3 * window + 1  # uniforms per verified segment: accept, coupling, extra, fresh
    dump = length + window  # column that absorbs writes of slots that commit nothing
    width = dump + 1

    record = Commits(batch, dump, dev)
    seq = record.tokens
    # cached[:, g + 1]: the cache holds the key of generated position g (g = -1: prompt end).
    cached = torch.zeros(batch, width + 1, dtype=torch.bool, device=dev)
    draft_tok = torch.zeros(batch, width, dtype=torch.long, device=dev)
    draft_law = torch.zeros(batch, width, vocab, device=dev)
    has_draft = torch.zeros(batch, width, dtype=torch.bool, device=dev)
    forward_passes = torch.zeros(batch, dtype=torch.long, device=dev)
    hist = torch.zeros(batch, window, dtype=torch.long, device=dev)
    init = FRESH_INITS[jacobi.draft_init](vocab, cols, batch, dev)
    coupling = COUPLINGS[jacobi.coupling](vocab, generators, dev)
    row_ids = torch.arange(n_rows, device=dev)[None]
    slots = torch.arange(window + 1, device=dev)
    gen_pos = torch.arange(-1, length - 1, device=dev)  # the cache columns a slot may see
    rule_seconds, it = 0.0, 0

    while True:
        done = record.step[:, :length] >= 0
        count = done.view(batch, n_rows, cols).sum(-1)  # committed per row
        act = (count.sum(1) < length).nonzero().squeeze(1)
        if act.numel() == 0:
            break
        b, c = act.numel(), count[act]  # [b, rows]

        # Which rows run this iteration, and how many outputs each window has.
        complete = c == cols
        top = (~complete).int().argmax(1)  # first unfinished row
        above = torch.cat([torch.full_like(c[:, :1], cols), c[:, :-1]], 1)
        below_top = row_ids > top[:, None]
        lower = below_top & (above >= ctx) & ~complete
        own = lower | (below_top & (c > 0))  # rows below the top that run on their own
        below = torch.cat([own[:, 1:], torch.zeros_like(own[:, :1])], 1)
        start = row_ids * cols + c  # first uncommitted position of each row
        # The top row stops at its row end when the next row runs on its own, else it runs on
        # in raster order (one-dimensional Jacobi over rows nobody has started).
        cap = torch.where(below, (row_ids + 1) * cols, length)
        outputs = torch.where(row_ids == top[:, None], (cap - start).clamp(max=window),
                              torch.where(lower, (above - c).clamp(max=window), 0))
        anchor = start - 1
        real = (c > 0) | (row_ids == 0) | (above == cols)  # else a stand-in opens the row
        verified = outputs > 0
        anchor_cached = cached[act[:, None], anchor + 1]
        # A finished row's last token is the anchor of the next row when that one starts now.
        shadowed = complete & torch.cat([(verified & (c == 0))[:, 1:],
                                         torch.zeros_like(verified[:, :1])], 1)
        flush = ~verified & (c > 0) & ~anchor_cached & ~shadowed
        n_in = torch.where(verified | flush, outputs.clamp(min=1), 0)  # input slots per row

        # Segments in image-major, row order.
        sb, sr = (verified | flush).nonzero(as_tuple=True)
        img = act[sb]
        seg_out, seg_in = outputs[sb, sr], n_in[sb, sr]
        seg_start, seg_anchor, seg_real = start[sb, sr], anchor[sb, sr], real[sb, sr]
        is_top = sr == top[sb]
        offset = (n_in.cumsum(1) - n_in)[sb, sr]
        n_slots = int(n_in.sum(1).max())
        L = int(seg_out.max())
        K = L - 1
        j = slots[:L]
        pos = seg_start[:, None] + j  # [G, L] generated positions of the outputs

        # Uniforms: one block per verified segment, drawn from each image's own stream.
        n_ver = verified.sum(1)
        rnd = draw_ragged(generators, act, n_ver * per, dev).view(b, -1, per)
        rank = (verified.cumsum(1) - 1).clamp(min=0)[sb, sr]
        rnd = rnd[sb, rank]  # [G, per]

        # Drafts: recycled ones first (stored by position), fresh ones after.
        dpos = pos[:, :K]
        d = draft_tok[img[:, None], dpos]
        dp = draft_law[img[:, None], dpos]
        n_rec = has_draft[img[:, None], dpos].long().cumprod(1).sum(1)
        fresh = j[:K] >= n_rec[:, None]
        fd, fdp = init.fill(FreshSlots(img, dpos, fresh, seg_start, seg_start + n_rec, d, dp,
                                       seq, rnd[:, 2 * window + 1 :][:, :K]))
        d = torch.where(fresh, fd, d)
        dp = torch.where(fresh[..., None], fdp, dp)

        # Pack: [anchor, drafts] of every segment of an image, one after the other.
        stand_in = (sr - 1) * cols + above[sb, sr] - 1  # last committed token of the row above
        anchor_tok = seq[img, torch.where(seg_real, seg_anchor, stand_in).clamp(min=0)]
        k_in = slots[:L]
        inputs = torch.cat([anchor_tok[:, None], d], 1)  # [G, L]
        fed = k_in < seg_in[:, None]
        col = torch.where(fed, offset[:, None] + k_in, n_slots)
        rows_b = sb[:, None].expand_as(col)
        p_tok = torch.zeros(b, n_slots + 1, dtype=torch.long, device=dev)
        p_pos = torch.zeros_like(p_tok)
        p_seg = torch.full_like(p_tok, -1)
        p_k = torch.zeros_like(p_tok)
        p_anchor = torch.full_like(p_tok, -1)
        p_store = torch.zeros(b, n_slots + 1, dtype=torch.bool, device=dev)
        p_tok[rows_b, col] = inputs
        p_pos[rows_b, col] = seg_anchor[:, None] + k_in
        p_seg[rows_b, col] = torch.arange(len(sb), device=dev)[:, None].expand_as(col)
        p_k[rows_b, col] = k_in.expand_as(col)
        p_anchor[rows_b, col] = seg_anchor[:, None].expand_as(col)
        p_store[rows_b, col] = (k_in > 0) | seg_real[:, None]
        p_tok, p_pos, p_seg, p_k, p_anchor, p_store = (
            t[:, :n_slots] for t in (p_tok, p_pos, p_seg, p_k, p_anchor, p_store))
        # Row-causal mask: cached keys before the segment's anchor, earlier slots of the segment.
        visible = cached[act, :length][:, None, :] & (gen_pos < p_anchor[..., None])
        own_seg = ((p_seg[:, :, None] == p_seg[:, None, :]) & (p_k[:, None, :] <= p_k[:, :, None])
                   & (p_seg >= 0)[..., None])  # padding sees no slot, not even itself
        cond, uncond = session.forward_packed(p_tok, p_pos, act, visible, own_seg, p_store)
        probs = target_probs(cond, uncond, sampling, model.layout.structural)  # [b, S, V]
        q = probs[sb[:, None], (offset[:, None] + j).clamp(max=n_slots - 1)]  # [G, L, V]

        acc, rejected, extra, y, y_dist, seconds = verify_window(
            rule, coupling, img, d, dp, q, pos, seg_out, rnd, window, profile=profile,
            ragged=True)
        rule_seconds += seconds

        # The top row commits its accepted drafts and the extra token; a lower row its accepted
        # drafts, plus the bonus token when none was rejected; flush segments commit nothing.
        takes_extra = is_top | ~rejected
        limit = torch.where(takes_extra, acc, acc - 1)
        limit = torch.where(seg_out > 0, limit, -1)
        d_pad = torch.cat([d, y[:, K:]], 1)
        out_tok = torch.where(j < acc[:, None], d_pad,
                              torch.where((j == acc[:, None]) & takes_extra[:, None],
                                          extra[:, None], y))
        keep = j <= limit[:, None]
        init.committed(img, pos, keep, q)
        rows_g = img[:, None]
        record.write(img, pos, keep, out_tok, it, j < acc[:, None], q)
        # Keys now in the cache: every real anchor, every accepted draft (both were fed).
        cached[img, torch.where(seg_real, seg_anchor + 1, width)] = True
        cached[rows_g, torch.where((j < acc[:, None]) & keep, pos + 1, width)] = True
        # Next drafts: the coupling's tokens after what was committed, stored by position.
        tail = (j > limit[:, None]) & (j < seg_out[:, None])
        cols_tail = torch.where(tail, pos, dump)
        draft_tok[rows_g, cols_tail] = out_tok
        draft_law[rows_g, cols_tail] = y_dist
        has_draft[rows_g, cols_tail] = True
        has_draft[:, dump] = False

        forward_passes[act] += 1
        ver = seg_out > 0
        hist.index_put_((img[ver], acc[ver]), torch.ones_like(acc[ver]), accumulate=True)
        it += 1
        if progress is not None:
            progress.update(int(keep.sum()))

    return record.result(length, forward_passes=forward_passes, accept_hist=hist,
                         iterations=it, rule_seconds=rule_seconds,
                         mean_window=torch.full((batch,), float(window), device=dev))
