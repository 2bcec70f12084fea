"""Two-dimensional windows: several image rows in flight at once (`row_context=c`).

An image token depends mostly on its neighbourhood, so row r + 1 need not wait for row r to
finish: it becomes active once row r has `c` committed tokens and then runs one window of its
own behind it, never passing the row above (its window ends at the column row r has reached).
One forward per iteration feeds every active row of every image; the window of each row is a
*segment* [anchor, draft_0 .. draft_{K-1}] of the packed input.

Row-causal attention: a segment's slots see every committed token whose key is in the cache and
earlier slots of their own segment, never another row's drafts. Committed tokens are no longer a
raster prefix, so the cache is addressed by position with a validity set (memory "rows.cached"):
the keys of the anchors and of the accepted drafts fed this iteration join it; a committed token
nobody fed yet (a row's last resampled token) is fed as an anchor, by its own row's next segment
or by a one-slot *flush* segment once the row has nothing more to draft.

The top active row resamples from the residual at its first rejection and always advances;
lower rows keep their accepted prefix (plus the bonus token when every draft passed) and defer
the rest: the rejected slot becomes the coupling's next draft. The top row's window runs on past
its row end into rows that are not active yet, so with c = a full row nothing ever runs beside
it and the decode is raster Jacobi decoding (same tokens for the same seed).

What this costs in exactness: a lower row's token is decided on a partial context (the right
end of the rows above is missing), so no rule stays lossless; a new row's first window is opened
by a stand-in anchor (the last committed token of the row above, at the position before the
row, its key left out of the cache), as PJD does for LlamaGen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import JacobiConfig
from ..models.base import ImageModel, Session
from .frontier import Frontier, Plan
from .state import DecodeState
from .verify import Commit, Verdict
from .window import WindowPolicy


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
        raise ValueError("row_context needs a fixed integer window (each active row gets one; "
                         "the window policy's cost model prices one segment per image); "
                         f"got window={policy if policy is not None else jacobi.window!r}")
    if jacobi.advance != "per_image":
        raise ValueError("row_context advances each row on its own; advance='batch_min' does "
                         "not apply")


@dataclass
class RowsPlan(Plan):
    """Plan plus the packing: act [b] images fed, seg_b [G] each segment's index in act,
    offset [G] its first packed slot, n_in [G] its fed slots, anchor [G] its anchor position,
    real [G] whether the anchor is the row's own committed token (else a stand-in), stand_in
    [G] the stand-in's position, n_slots the packed width."""

    act: torch.Tensor | None = None
    seg_b: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    n_in: torch.Tensor | None = None
    anchor: torch.Tensor | None = None
    real: torch.Tensor | None = None
    stand_in: torch.Tensor | None = None
    n_slots: int = 0


class Rows(Frontier):
    key = "rows.cached"  # [B, T + 2]: column g + 1 holds whether the key of position g is cached

    def __init__(self, model: ImageModel, window: int, context: int) -> None:
        self.max_window, self.ctx = window, context
        self.length = model.layout.length
        self.n_rows, self.cols = model.layout.grid

    def ring(self, model: ImageModel) -> int:
        return self.length  # every position of the image may hold a draft

    def begin(self, model, session, state, cfg, lossless, costs=None):  # noqa: ANN001, ANN201
        dev = state.count.device
        state.memory[self.key] = torch.zeros(state.batch, self.length + 2, dtype=torch.bool,
                                             device=dev)
        self.row_ids = torch.arange(self.n_rows, device=dev)[None]
        self.gen_pos = torch.arange(-1, self.length - 1, device=dev)  # cache columns a slot sees

    def summary(self, state: DecodeState) -> torch.Tensor:
        """Per image and row: whether it runs, verifies, its outputs and fed slots."""
        cols, ids, cached = self.cols, self.row_ids, state.memory[self.key]
        done = state.step[:, : self.length] >= 0
        c = done.view(state.batch, self.n_rows, cols).sum(-1)  # committed per row
        active = (c.sum(1) < self.length)[:, None]
        complete = c == cols
        top = (~complete).int().argmax(1)  # first unfinished row
        above = torch.cat([torch.full_like(c[:, :1], cols), c[:, :-1]], 1)
        below_top = ids > top[:, None]
        lower = below_top & (above >= self.ctx) & ~complete
        own = lower | (below_top & (c > 0))  # rows below the top that run on their own
        below = torch.cat([own[:, 1:], torch.zeros_like(own[:, :1])], 1)
        start = ids * cols + c  # first uncommitted position of each row
        # The top row stops at its row end when the next row runs on its own, else it runs on
        # in raster order (one-dimensional Jacobi over rows nobody has started).
        cap = torch.where(below, (ids + 1) * cols, self.length)
        outputs = torch.where(ids == top[:, None], (cap - start).clamp(max=self.max_window),
                              torch.where(lower, (above - c).clamp(max=self.max_window), 0))
        verified = (outputs > 0) & active
        # A finished row's last token is the anchor of the next row when that one starts now.
        shadowed = complete & torch.cat([(verified & (c == 0))[:, 1:],
                                         torch.zeros_like(verified[:, :1])], 1)
        flush = ~verified & (c > 0) & ~cached.gather(1, start) & ~shadowed & active
        n_in = torch.where(verified | flush, outputs.clamp(min=1), 0)  # input slots per row
        self.rows = {"start": start, "outputs": outputs, "top": top, "above": above,
                     "real": (c > 0) | (ids == 0) | (above == cols)}
        return torch.cat([(verified | flush).flatten(), verified.flatten(), outputs.flatten(),
                          n_in.flatten()]).long()

    def plan(self, state: DecodeState, counts: list[int], host: list[int]) -> RowsPlan | None:
        n, rows = state.batch * self.n_rows, self.n_rows
        runs, ver, outs, n_in = (host[i * n : (i + 1) * n] for i in range(4))
        act = [i for i in range(state.batch) if any(runs[i * rows : (i + 1) * rows])]
        if not act:
            return None
        # Segments in image-major, row order; host-side bookkeeping of where each one goes.
        seg, n_ver, urows, offsets, widths = [], [], [], [], []
        for b, i in enumerate(act):
            base, done_ver, slot = sum(n_ver), 0, 0
            for r in range(rows):
                k = i * rows + r
                if runs[k]:
                    done_ver += ver[k]
                    seg.append((i, r, b))
                    urows.append(base + max(done_ver - 1, 0))
                    offsets.append(slot)
                    slot += n_in[k]
            n_ver.append(done_ver)
            widths.append(slot)
        dev = state.count.device
        img, sr, sb, urow, offset = torch.tensor(
            [[s[0] for s in seg], [s[1] for s in seg], [s[2] for s in seg], urows, offsets],
            device=dev)
        p = {k: v[img, sr] for k, v in self.rows.items() if k != "top"}
        width = max(outs[i * rows + r] for i, r, _ in seg)
        pos = p["start"][:, None] + torch.arange(width, device=dev)
        above = p.pop("above")
        return RowsPlan(
            act, n_ver, urow, img, p["start"], p["outputs"], pos,
            sr == self.rows["top"][img], None, self.max_window, ragged=True,
            act=torch.tensor(act, device=dev), seg_b=sb, offset=offset,
            n_in=torch.where((p["outputs"] > 0), p["outputs"], 1), anchor=p["start"] - 1,
            real=p["real"], stand_in=(sr - 1) * self.cols + above - 1, n_slots=max(widths))

    def forward(self, session: Session, plan: RowsPlan, state: DecodeState,
                drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pack [anchor, drafts] of every segment of an image one after the other, with the
        row-causal mask: cached keys before the segment's anchor, earlier slots of the segment."""
        b, n_slots, dev = len(plan.act), plan.n_slots, drafts.device
        width = plan.pos.shape[1]
        anchor_tok = state.tokens[plan.img, torch.where(plan.real, plan.anchor,
                                                        plan.stand_in).clamp(min=0)]
        k_in = torch.arange(width, device=dev)
        inputs = torch.cat([anchor_tok[:, None], drafts], 1)  # [G, L]
        fed = k_in < plan.n_in[:, None]
        col = torch.where(fed, plan.offset[:, None] + k_in, n_slots)
        rows_b = plan.seg_b[:, None].expand_as(col)

        def packed(values: torch.Tensor, fill: int, dtype=torch.long) -> torch.Tensor:  # noqa: ANN001
            out = torch.full((b, n_slots + 1), fill, dtype=dtype, device=dev)
            out[rows_b, col] = values.to(dtype).expand_as(col)
            return out[:, :n_slots]

        p_seg = packed(torch.arange(len(plan.img), device=dev)[:, None], -1)
        p_k, p_anchor = packed(k_in[None], 0), packed(plan.anchor[:, None], -1)
        p_store = packed((k_in > 0) | plan.real[:, None], False, torch.bool)
        visible = (state.memory[self.key][plan.act, : self.length][:, None, :]
                   & (self.gen_pos < p_anchor[..., None]))
        own_seg = ((p_seg[:, :, None] == p_seg[:, None, :]) & (p_k[:, None, :] <= p_k[:, :, None])
                   & (p_seg >= 0)[..., None])  # padding sees no slot, not even itself
        cond, uncond = session.forward_packed(packed(inputs, 0), packed(plan.anchor[:, None] + k_in,
                                                                        0),
                                              plan.act, visible, own_seg, p_store)
        at = (plan.seg_b[:, None], (plan.offset[:, None] + k_in).clamp(max=n_slots - 1))
        return cond[at], None if uncond is None else uncond[at]

    def observe(self, state: DecodeState, plan: RowsPlan, verdict: Verdict,
                commit: Commit) -> None:
        cached, img, dump = state.memory[self.key], plan.img, self.length + 1
        # Keys now in the cache: every real anchor, every accepted draft (both were fed).
        cached[img, torch.where(plan.real, plan.anchor + 1, dump)] = True
        cached[img[:, None], torch.where(commit.drafted & commit.keep, plan.pos + 1, dump)] = True
        state.ran(plan.act, self.max_window)
        verified = (plan.outputs > 0).long()
        state.accept_hist.index_put_((img, verdict.accepted), verified, accumulate=True)
