"""Drafting: what the window's draft slots hold. The third part of the engine beside the loop and
the acceptance rule; rules never see it.

The loop asks two questions every iteration:
(a) *fresh slots* (positions no earlier iteration drafted): which token, declared as drawn from
    which distribution? That is a `FreshInit` (option `draft_init`).
(b) *tail slots* (after the first rejection): how do this iteration's drafts and targets become
    the next iteration's drafts? That is a `Coupling` (option `coupling`).

Contract that keeps every rule exact: a declared draft distribution is the law the token was
actually drawn from, given everything that decides whether its slot is reached. The acceptance
rule may be relaxed (it decides what is committed); the keep-or-redraw of tail slots never is.
Adding a drafter means writing one subclass of either base and registering its name.

Shapes: b active images, K draft slots, L = K + 1 output slots, V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..acceptance.functional import acceptance_ratio, residual_probs
from ..sampling import gumbel_argmax, sample_with_uniform, target_probs


@dataclass
class FreshSlots:
    """What a `FreshInit` may look at for one iteration.

    act [b]: which images of the batch. pos [b, K]: generated positions of the draft slots.
    fresh [b, K] bool: slots to fill. committed_len [b]: committed tokens per image (n).
    first_fresh [b]: position of each image's first fresh slot (everything before it is
    committed or an earlier draft). drafts [b, K], draft_probs [b, K, V]: the slots as recycled
    (meaningful where not fresh). committed [B, >=T]: committed tokens by position, for the
    whole batch (index it with act).
    uniforms [b, K]: one uniform per slot, independent of every other use.
    memory: the decode's per-image memory (DecodeState.memory), where a drafter keeps its own.
    """

    act: torch.Tensor
    pos: torch.Tensor
    fresh: torch.Tensor
    committed_len: torch.Tensor
    first_fresh: torch.Tensor
    drafts: torch.Tensor
    draft_probs: torch.Tensor
    committed: torch.Tensor
    uniforms: torch.Tensor
    memory: dict[str, torch.Tensor]


class FreshInit(ABC):
    """Fills fresh draft slots. Stateless: per-image state lives in the decode's memory."""

    name: str

    def __init__(self, vocab: int, row_stride: int) -> None:
        self.vocab, self.row_stride = vocab, row_stride

    def begin(self, memory: dict[str, torch.Tensor], generators: list[torch.Generator],
              device: torch.device) -> None:  # noqa: B027 - optional hook
        """Called once per decode before anything is drawn: allocate per-image memory."""

    @abstractmethod
    def fill(self, s: FreshSlots) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens [b, K], declared draft distributions [b, K, V]); only fresh slots are read."""

    def committed(self, memory: dict[str, torch.Tensor], act: torch.Tensor, pos: torch.Tensor,
                  keep: torch.Tensor, target_probs: torch.Tensor) -> None:  # noqa: B027
        """Told the targets of the positions each image committed this iteration (keep [b, L])."""

    def _uniform_tokens(self, s: FreshSlots) -> torch.Tensor:
        return (s.uniforms * self.vocab).long().clamp_(max=self.vocab - 1)

    def _uniform_probs(self, s: FreshSlots) -> torch.Tensor:
        return s.draft_probs.new_full((1, 1, self.vocab), 1.0 / self.vocab)  # broadcasts

    def _above(self, s: FreshSlots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Nearest position straight above each slot that is not itself fresh: [b, K]; whether
        it exists (False in the first row); and whether it is committed (else it is the recycled
        draft at slot src - committed_len)."""
        k = torch.div(s.pos - s.first_fresh[:, None], self.row_stride, rounding_mode="floor") + 1
        src = s.pos - self.row_stride * k
        return src, src >= 0, src < s.committed_len[:, None]

    def _draft_slot(self, s: FreshSlots, src: torch.Tensor) -> torch.Tensor:
        """Window slot of a recycled draft at position src (clamped where src is committed)."""
        return (src - s.committed_len[:, None]).clamp(min=0, max=s.drafts.shape[1] - 1)


def _onehot(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, vocab).to(dtype)


class UniformInit(FreshInit):
    """A uniform random token declared uniform (CSD's and SJD-PAC's code)."""

    name = "uniform"

    def fill(self, s: FreshSlots) -> tuple[torch.Tensor, torch.Tensor]:
        return self._uniform_tokens(s), self._uniform_probs(s).expand_as(s.draft_probs)


class OneHotInit(FreshInit):
    """A uniform random token declared one-hot at itself (SJD's code); exact, accepted less."""

    name = "onehot"

    def fill(self, s: FreshSlots) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self._uniform_tokens(s)
        return tokens, _onehot(tokens, self.vocab, s.draft_probs.dtype)


class VerticalInit(FreshInit):
    """The token one row above (committed, or the recycled draft there), declared one-hot: a
    deterministic function of known tokens, so one-hot is its exact law (SJD paper, Fig. 9).
    First-row slots fall back to uniform."""

    name = "vertical"

    def fill(self, s: FreshSlots) -> tuple[torch.Tensor, torch.Tensor]:
        src, has, committed = self._above(s)
        above = torch.where(committed, s.committed[s.act[:, None], src.clamp(min=0)],
                            s.drafts.gather(1, self._draft_slot(s, src)))
        tokens = torch.where(has, above, self._uniform_tokens(s))
        probs = torch.where(has[..., None], _onehot(tokens, self.vocab, s.draft_probs.dtype),
                            self._uniform_probs(s))
        return tokens, probs


class VerticalSampleInit(FreshInit):
    """A sample from the target distribution stored for the slot above (committed: the target
    that decided it; recycled: its declared draft distribution), declared as that distribution.
    Keeps one row of distributions per image. First-row slots fall back to uniform."""

    name = "vertical_sample"

    key = "vertical_sample.ring"

    def begin(self, memory: dict[str, torch.Tensor], generators: list[torch.Generator],
              device: torch.device) -> None:
        # Ring of the last row of committed targets, by position mod stride; the extra entry
        # absorbs writes that are not needed.
        memory[self.key] = torch.full((len(generators), self.row_stride + 1, self.vocab),
                                      1.0 / self.vocab, device=device)

    def fill(self, s: FreshSlots) -> tuple[torch.Tensor, torch.Tensor]:
        src, has, committed = self._above(s)
        ring = s.memory[self.key]
        ring_rows = ring[s.act[:, None], src.clamp(min=0) % self.row_stride]  # [b, K, V]
        slot = self._draft_slot(s, src)[..., None].expand_as(s.draft_probs)
        probs = torch.where(committed[..., None], ring_rows, s.draft_probs.gather(1, slot))
        probs = torch.where(has[..., None], probs, self._uniform_probs(s))
        return sample_with_uniform(probs, s.uniforms), probs

    def committed(self, memory: dict[str, torch.Tensor], act: torch.Tensor, pos: torch.Tensor,
                  keep: torch.Tensor, target_probs: torch.Tensor) -> None:
        # Only the last row of committed positions matters; older ones would collide mod stride.
        last = (pos * keep).max(1, keepdim=True).values
        write = keep & (pos > last - self.row_stride)
        slot = torch.where(write, pos % self.row_stride, self.row_stride)
        memory[self.key][act[:, None], slot] = target_probs


@dataclass
class Tail:
    """One iteration's window after verification, for a `Coupling`.

    drafts [b, K] and draft_probs [b, K, V]: what was verified; target_probs [b, L, V];
    pos [b, L] generated positions; u_keep [b, L] and u_draw [b, L]: uniforms (u_keep is the
    verification uniform, reused: a tail slot's verification never decides anything).
    n_drafts [b] or None: drafts each window really has when windows of several lengths share
    the batch (slots at and after it hold no draft); None: all K. memory: the decode's
    per-image memory (DecodeState.memory). noise [b, L, V]: the images' exponential noise
    at pos (given when the coupling's `needs_noise`, or under Gumbel verification).
    """

    act: torch.Tensor
    drafts: torch.Tensor
    draft_probs: torch.Tensor
    target_probs: torch.Tensor
    pos: torch.Tensor
    u_keep: torch.Tensor
    u_draw: torch.Tensor
    n_drafts: torch.Tensor | None = None
    memory: dict[str, torch.Tensor] | None = None
    noise: torch.Tensor | None = None


class Coupling(ABC):
    """Turns a verified window into the next drafts of its tail slots. Stateless: per-image
    state lives in the decode's memory."""

    name: str
    needs_noise = False  # redraft() reads Tail.noise

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def begin(self, memory: dict[str, torch.Tensor], generators: list[torch.Generator],
              device: torch.device) -> None:  # noqa: B027 - optional hook
        """Called once per decode before anything is drawn: allocate per-image memory."""

    @abstractmethod
    def redraft(self, t: Tail) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (next drafts [b, L], their declared distributions [b, L, V]), for every slot; the
        loop uses those after the first rejection. Each token's law must be its declared one."""


class Independent(Coupling):
    """SJD: every tail slot redrawn independently from the new target."""

    name = "none"

    def redraft(self, t: Tail) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_with_uniform(t.target_probs, t.u_draw), t.target_probs


class Maximal(Coupling):
    """Maximal coupling (SCD's pi_MC, SJD-PAC's adaptive continuation): keep the old draft with
    probability min(1, target/draft), else draw from norm(max(0, target - draft)). The result
    is distributed as the new target, which is what it declares (the public code declares the
    old draft distribution for kept tokens, which is not exact)."""

    name = "maximal"

    def redraft(self, t: Tail) -> tuple[torch.Tensor, torch.Tensor]:
        k = t.drafts.shape[1]
        q = t.target_probs
        keep = t.u_keep[:, :k] < acceptance_ratio(t.drafts, t.draft_probs, q[:, :k])
        res = residual_probs(t.draft_probs, q[:, :k])
        if t.n_drafts is not None:  # no draft to keep: a plain draw from the target
            real = torch.arange(k, device=q.device) < t.n_drafts[:, None]
            keep &= real
            res = torch.where(real[..., None], res, q[:, :k])
        redrawn = sample_with_uniform(res, t.u_draw[:, :k])
        last = sample_with_uniform(q[:, k:], t.u_draw[:, k:])  # no draft there yet
        return torch.cat([torch.where(keep, t.drafts, redrawn), last], 1), q


class GumbelShared(Coupling):
    """Gumbel-sharing coupling (SCD's pi_GS): draft = argmax(log target + G), G the image's
    noise at the slot's position (sampling.exponential_noise, the noise Gumbel verification and AR
    sampling use too), so consecutive drafts agree where the target barely moved."""

    name = "gumbel"

    needs_noise = True

    def redraft(self, t: Tail) -> tuple[torch.Tensor, torch.Tensor]:
        return gumbel_argmax(t.target_probs, t.noise), t.target_probs


FRESH_INITS: dict[str, type[FreshInit]] = {
    c.name: c for c in (UniformInit, OneHotInit, VerticalInit, VerticalSampleInit)
}
COUPLINGS: dict[str, type[Coupling]] = {c.name: c for c in (Independent, Maximal, GumbelShared)}



def blend_for(head, blend: float | None) -> float:  # noqa: ANN001
    """The exponent of the stale law in a head's product: `blend`, or by default 0.5 for a
    plain head and 0 for a stale head (where its first step read the stale feature itself;
    HeadDrafter uses 0.5 at the steps that did not)."""
    return (0.0 if head.cfg.stale else 0.5) if blend is None else float(blend)


def _product(head: torch.Tensor, stale: torch.Tensor,
             weight: float | torch.Tensor) -> torch.Tensor:
    """head * stale ** weight, normalised (a product of experts; uniform where both vanish)."""
    log = torch.log(head.clamp_min(1e-30)) + weight * torch.log(stale.clamp_min(1e-30))
    return torch.softmax(log, -1)


class HeadDrafter:
    """A trained draft head (drafter/head.py) at the head of each window: from the target's
    feature that decided an image's last committed position, a chain of `depth` steps drafts
    positions start .. start + depth - 1, each step fed the token the step before drafted.

    Each slot's law is the head's law mixed and warped as the target's is (guidance, top-k,
    temperature, structural tokens), times the law of the draft already waiting at the slot (the
    target's own on a stale context, or the initialiser's) to the power `blend`, normalised:
    the stale law knows the whole image, the head the token just committed. Under Gumbel
    verification the draft is the argmax of that law over the position's noise, under the ratio
    test a sample of it with the slot's fresh uniform, and the declared law is that law. A
    step depends only on committed tokens, the last forward (the waiting draft's declared law,
    a stale feature) and the chain's earlier drafts, which are the committed tokens whenever
    its slot is reached, so every rule keeps its law. Images with no feature yet (nothing
    committed) keep the loop's own drafts. Memory: the last deciding feature per image (cond,
    and uncond with guidance); for a `stale` head also the forward's feature one slot past the
    commit (computed with the rejected draft as its input), that draft and its position, which
    the first step reads. blend None: 0.5, but 0 where a stale head's first step read the
    stale feature (its input already holds the stale law's information).
    """

    feat_key, has_key = "head.feature", "head.has"
    stale_key, stale_tok_key, stale_pos_key = "head.stale", "head.stale_token", "head.stale_pos"

    def __init__(self, head, io, sampling, structural: tuple[int, ...], depth: int | None,  # noqa: ANN001
                 blend: float | None = None) -> None:
        self.head, self.io, self.sampling, self.structural = head, io, sampling, structural
        self.depth = head.cfg.depth if depth is None else depth
        self.stride = head.cfg.stride
        self.stale = head.cfg.stale
        self.blend = 0.5 if blend is None else float(blend)  # where no stale feature was read
        self.stale_blend = blend_for(head, blend)  # where a stale head's first step read one
        self.rows = 2 if sampling.uses_cfg else 1
        p = next(head.parameters())
        self.dtype, self.device = p.dtype, p.device

    def begin(self, memory: dict[str, torch.Tensor], generators: list[torch.Generator],
              device: torch.device) -> None:
        b = len(generators)
        memory[self.feat_key] = torch.zeros(b, self.rows, self.io.dim, device=device,
                                            dtype=self.dtype)
        memory[self.has_key] = torch.zeros(b, dtype=torch.bool, device=device)
        if self.stale:
            memory[self.stale_key] = torch.zeros_like(memory[self.feat_key])
            memory[self.stale_tok_key] = torch.zeros(b, dtype=torch.long, device=device)
            memory[self.stale_pos_key] = torch.full((b,), -1, dtype=torch.long, device=device)

    def draft(self, memory: dict[str, torch.Tensor], img: torch.Tensor, start: torch.Tensor,
              committed: torch.Tensor, slots: int, noise: torch.Tensor | None,
              uniforms: torch.Tensor, forced: torch.Tensor | None,
              stale: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [b, D], laws [b, D, V] for slots 0 .. D - 1 (D = min(depth, slots)) and
        which images use them [b]. committed [B, >=T]: committed tokens by position; noise
        [b, >=D, V] under Gumbel verification (else None: sample with uniforms [b, >=D]);
        forced [b, >=D] (-1 where free) or None."""
        depth = min(self.depth, slots)
        b, r = len(img), self.rows
        use = memory[self.has_key][img] & (start > 0)
        feat = memory[self.feat_key][img].reshape(b * r, -1)
        prev = committed[img, (start - 1).clamp(min=0)]
        tokens, laws = [], []
        for j in range(depth):
            p = start + j
            above_pos = p - self.stride
            has_above = (above_pos >= 0) & (above_pos < start)  # committed above
            above = committed[img, above_pos.clamp(min=0)]
            first_stale = self.stale and j == 0
            ids = [prev, above] + ([memory[self.stale_tok_key][img]] if first_stale else [])
            emb = self.io.embed(torch.stack(ids, 1)).to(self.dtype)
            stale_in = None
            if first_stale:  # the stale feature computed at this very position
                has = memory[self.stale_pos_key][img] == start
                stale_in = (memory[self.stale_key][img].reshape(b * r, -1),
                            emb[:, 2].repeat_interleave(r, 0), has.repeat_interleave(r, 0))
            h = self.head(feat, emb[:, 0].repeat_interleave(r, 0),
                          emb[:, 1].repeat_interleave(r, 0), has_above.repeat_interleave(r, 0),
                          p.clamp(max=self.head.cfg.length).repeat_interleave(r, 0), stale_in)
            logits = self.io.logits(h.to(self.io.dtype)).view(b, r, -1)
            law = target_probs(logits[:, 0], logits[:, 1] if r == 2 else None, self.sampling,
                               self.structural, check=False)
            law = torch.nan_to_num(law, nan=1.0 / law.shape[-1])  # a head never breaks a decode
            weight = self.blend
            if first_stale and self.stale_blend != self.blend:
                weight = torch.where(has, self.stale_blend, self.blend)[:, None].to(law.dtype)
            if stale is not None and (torch.is_tensor(weight) or weight > 0):
                law = _product(law, stale[:, j], weight)
            tok = (gumbel_argmax(law, noise[:, j]) if noise is not None
                   else sample_with_uniform(law, uniforms[:, j]))
            if forced is not None:
                tok = torch.where(forced[:, j] >= 0, forced[:, j], tok)
            tokens.append(tok)
            laws.append(law)
            feat, prev = h, tok
        return torch.stack(tokens, 1), torch.stack(laws, 1), use

    def observe(self, memory: dict[str, torch.Tensor], img: torch.Tensor, keep: torch.Tensor,
                features: tuple[torch.Tensor, torch.Tensor | None],
                decider: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                drafts: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> None:
        """After the commit: keep [b, L] the committed slots; features: the forward's
        (cond, uncond) [b, S, dim]. The feature of the slot that decided each image's last
        committed position (`decider` [b], default its last kept slot) is where the next chain
        starts. A stale head also keeps, for a chain (no decider), the feature of the next slot
        where it stays in flight (tail [b, L]), the draft that was its input (drafts [b, K]) and
        its position (pos [b, L])."""
        got = keep.any(1)
        ar = torch.arange(len(img), device=img.device)
        last = decider if decider is not None else (
            keep.long() * torch.arange(1, keep.shape[1] + 1, device=keep.device)).argmax(1)
        parts = [f for f in features if f is not None][: self.rows]
        feat = torch.stack([f[ar, last] for f in parts], 1)
        old = memory[self.feat_key][img]
        memory[self.feat_key][img] = torch.where(got[:, None, None], feat.to(self.dtype), old)
        memory[self.has_key][img] |= got
        if not self.stale:
            return
        if decider is not None or drafts is None or drafts.shape[1] == 0:
            memory[self.stale_pos_key][img] = -1
            return
        slots, K = min(keep.shape[1], parts[0].shape[1]), drafts.shape[1]
        nxt = (last + 1).clamp(max=slots - 1)
        ok = got & (last + 1 < slots) & (last < K) & tail[ar, nxt]
        memory[self.stale_key][img] = torch.stack([f[ar, nxt] for f in parts], 1).to(self.dtype)
        memory[self.stale_tok_key][img] = drafts[ar, last.clamp(max=K - 1)]
        memory[self.stale_pos_key][img] = torch.where(ok, pos[ar, nxt], -1)
