"""Content-aware speculative decoding (CSD): entropy-relaxed acceptance behind a
distribution-alignment filter.

    b_k = min(1, target_k(x) / draft_k(x) + eps_k),
    eps_k = lam * H(target_k)   if D(draft_k, target_k) < delta   else 0,

H in nats (not normalised by log V, as the CSD code). D is the filter: total variation "tv"
(the paper's default), "kl" = KL(draft || target) or "rkl" = KL(target || draft) (the paper's
Table 4 variants). Resampling keeps norm(max(0, target - draft)), which the paper (Thm. 3.1)
proves TV-optimal for any acceptance between the lossless one and 1.

lam >= 0 (default 0.5): how much the target's entropy relaxes acceptance. delta in [0, 1]
(default 0.65): the filter threshold; 0.35 favours quality, 0.65-0.8 speed. lam = 0 or
delta = 0 is exactly SJD.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import functional as Fn
from .base import AcceptanceRule, check_nonnegative, check_unit

FILTERS = ("tv", "kl", "rkl")


@dataclass(frozen=True)
class CSD(AcceptanceRule):
    name = "csd"
    lossless = False
    lam: float = 0.5
    delta: float = 0.65
    filter: str = "tv"

    def __post_init__(self) -> None:
        check_nonnegative("lam", self.lam)
        check_unit("delta", self.delta)
        if self.filter not in FILTERS:
            raise ValueError(f"unknown filter {self.filter!r}; valid: {FILTERS}")

    @property
    def exact(self) -> bool:
        return self.lam == 0 or self.delta == 0

    def discrepancy(self, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
        if self.filter == "tv":
            return Fn.total_variation(draft_probs, target_probs)
        if self.filter == "kl":
            return Fn.kl_divergence(draft_probs, target_probs)
        return Fn.kl_divergence(target_probs, draft_probs)

    def compute_acceptance(self, draft_tokens, draft_probs, target_probs):  # noqa: ANN001, ANN201
        ratio = Fn.acceptance_ratio(draft_tokens, draft_probs, target_probs)
        aligned = self.discrepancy(draft_probs, target_probs) < self.delta
        relax = torch.where(aligned, self.lam * Fn.entropy(target_probs), torch.zeros_like(ratio))
        return (ratio + relax).clamp(max=1.0)
