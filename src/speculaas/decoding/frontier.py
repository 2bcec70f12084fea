"""Frontiers: which positions each image runs next. The only part of the loop that differs by
decoding order (raster here, several rows at once in frontier_rows.py).

Every iteration the loop asks its frontier three things:
  summary(state)        a 1-D long tensor of what the plan needs on the host (the window the
                        policy chose); the loop reads it, with the committed counts and the
                        previous iteration's finiteness flag, in its one host synchronisation
  plan(state, ...)      the segments to verify: per segment its image, the positions of its
                        output slots, how many are real, whether a rejection commits the
                        residual token (it does in raster order), forced tokens
  forward(...)          one target forward over every segment's [anchor, drafts]
and after verification observe(...) (forward counts, the acceptance histogram, the policy).
Segments of one plan share a width L = K + 1; a segment with fewer real outputs is ragged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..models.base import ImageModel, Session
from .state import DecodeState, Uniforms
from .verify import Commit, Verdict, Window
from .window import WindowPolicy


@dataclass
class Plan:
    """G segments of width L. images / segments: host lists, the images that verify something
    and how many segments each verifies (one block of uniforms each, image-major). urow [G]: the
    uniform block of each segment. img [G], start [G] (first output position), outputs [G] (real
    output slots, 0: the segment only feeds its anchor), pos [G, L], takes_extra [G] bool,
    forced [G, L] or None (-1 where free), window: the uniform block width."""

    images: list[int]
    segments: list[int]
    urow: torch.Tensor
    img: torch.Tensor
    start: torch.Tensor
    outputs: torch.Tensor
    pos: torch.Tensor
    takes_extra: torch.Tensor
    forced: torch.Tensor | None
    window: int
    ragged: bool = False


class Frontier(ABC):
    max_window: int  # widest segment; the uniform block width and the histogram's

    def ring(self, model: ImageModel) -> int:
        """Draft slots kept per image (positions in flight at once)."""
        return self.max_window

    def begin(self, model: ImageModel, session: Session, state: DecodeState, cfg: bool,
              lossless: bool, costs=None) -> None:  # noqa: ANN001, B027 - optional hook
        """Called once per decode; costs: the decode's cost-curve source (costs.CurveSource)."""

    @abstractmethod
    def summary(self, state: DecodeState) -> torch.Tensor:
        """1-D long tensor on the device; its host copy is handed to plan()."""

    @abstractmethod
    def plan(self, state: DecodeState, counts: list[int], host: list[int]) -> Plan | None:
        """The segments of this iteration (counts: committed positions per image, host: the
        summary); None when every image is finished."""

    @abstractmethod
    def forward(self, session: Session, plan: Plan, state: DecodeState,
                drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed every segment's anchor and drafts [G, K]: (cond, uncond) logits [G, L, V]."""

    def limit(self, plan: Plan, verdict: Verdict) -> torch.Tensor | None:
        """Last committed slot per segment if the order overrides settle()'s default."""
        return None

    def propose(self, drafts: torch.Tensor, laws: torch.Tensor,  # noqa: B027 - optional hook
                noise: torch.Tensor | None) -> None:
        """Before the forward: the drafts [G, K], their laws and the noise (if any) of the
        plan's segments, for an order that adds candidates of its own (tree.py)."""

    def extend(self, window: Window, verdict: Verdict, commit: Commit,
               uniforms: Uniforms) -> tuple[Commit, torch.Tensor]:
        """After settle(): an order that verified more than the chain may commit more (tree.py).
        -> the commit and the targets [G, L, V] that decided each slot."""
        return commit, window.target_probs

    @abstractmethod
    def observe(self, state: DecodeState, plan: Plan, verdict: Verdict, commit: Commit) -> None:
        """After the commit: forward counts, the acceptance histogram, the order's own memory."""


class Raster(Frontier):
    """One segment per unfinished image, starting at its committed length, as wide as the window
    policy says (one window for the batch; the forward is as wide as its widest window anyway).
    advance="batch_min": every image commits as many tokens as the batch's worst (the reference
    code's lock step); the others keep their accepted drafts, with their old laws, as drafts."""

    def __init__(self, model: ImageModel, policy: WindowPolicy, batch_min: bool = False) -> None:
        self.policy, self.batch_min, self.max_window = policy, batch_min, policy.max_window
        self.length = model.layout.length
        forced = model.layout.forced.to(model.device)
        self.forced = (torch.cat([forced, forced.new_full((self.max_window,), -1)])
                       if bool((forced >= 0).any()) else None)  # raster layouts skip that work

    def begin(self, model, session, state, cfg, lossless, costs=None):  # noqa: ANN001, ANN201
        self.policy.begin(model, session, cfg, lossless=lossless, costs=costs)

    def summary(self, state: DecodeState) -> torch.Tensor:
        return self.policy.choose(state.count < self.length).view(1)

    def plan(self, state: DecodeState, counts: list[int], host: list[int]) -> Plan | None:
        window = host[0]
        images = [i for i, n in enumerate(counts) if n < self.length]
        if not images:
            return None
        starts = [counts[i] for i in images]
        outputs = [min(self.length - n, window) for n in starts]
        width, dev = max(outputs), state.count.device
        img, start, out = torch.tensor([images, starts, outputs], device=dev)
        pos = start[:, None] + torch.arange(width, device=dev)
        self.window, self.max_start = window, max(starts)
        self.policy.started(window, len(images))
        return Plan(images, [1] * len(images), torch.arange(len(images), device=dev), img,
                    start, out, pos, torch.ones_like(img, dtype=torch.bool),
                    None if self.forced is None else self.forced[pos], self.max_window)

    def forward(self, session, plan, state, drafts):  # noqa: ANN001, ANN201
        anchor = state.tokens[plan.img, (plan.start - 1).clamp(min=0)]
        return session.forward(torch.cat([anchor[:, None], drafts], 1), plan.start, plan.img,
                               max_offset=self.max_start)

    def limit(self, plan: Plan, verdict: Verdict) -> torch.Tensor | None:
        return verdict.accepted.min().expand_as(verdict.accepted) if self.batch_min else None

    def observe(self, state: DecodeState, plan: Plan, verdict: Verdict, commit: Commit) -> None:
        state.ran(plan.img, self.window)
        state.accept_hist.index_put_((plan.img, commit.limit), torch.ones_like(plan.img),
                                     accumulate=True)
        self.policy.observe(plan.img, torch.full_like(plan.img, self.window), plan.outputs,
                            verdict.accepted)
