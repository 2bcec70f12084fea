"""The CSD paper's relaxation baselines (Table 1/2 rows "Amplify" and "Addition").

Amplify (the lenience of Leviathan et al., 2023): accept with min(1, k * target(x) / draft(x)),
k >= 1 (k = 1 is SJD). Addition (Yin et al., 2024): min(1, target(x) / draft(x) + eps), eps >= 0
(eps = 0 is SJD). Both keep the lossless residual.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import functional as Fn
from .base import AcceptanceRule, check_nonnegative


@dataclass(frozen=True)
class Amplify(AcceptanceRule):
    name = "amplify"
    lossless = False
    k: float = 1.3

    def __post_init__(self) -> None:
        if not isinstance(self.k, (int, float)) or not self.k >= 1:
            raise ValueError(f"amplify k must be >= 1, got {self.k!r}")

    @property
    def exact(self) -> bool:
        return self.k == 1

    def compute_acceptance(self, draft_tokens, draft_probs, target_probs):  # noqa: ANN001, ANN201
        return (self.k * Fn.acceptance_ratio(draft_tokens, draft_probs, target_probs)).clamp(
            max=1.0
        )


@dataclass(frozen=True)
class Addition(AcceptanceRule):
    name = "addition"
    lossless = False
    eps: float = 0.1

    def __post_init__(self) -> None:
        check_nonnegative("eps", self.eps)

    @property
    def exact(self) -> bool:
        return self.eps == 0

    def compute_acceptance(self, draft_tokens, draft_probs, target_probs):  # noqa: ANN001, ANN201
        return (Fn.acceptance_ratio(draft_tokens, draft_probs, target_probs) + self.eps).clamp(
            max=1.0
        )
