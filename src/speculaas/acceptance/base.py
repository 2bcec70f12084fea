"""The acceptance-rule interface: a frozen dataclass over the pure functions in functional.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import is_integer, is_number  # noqa: F401 - re-exported for the rule files
from . import functional as Fn


def check_inputs(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> None:
    """Shapes and ranges of a rule's inputs; raises ValueError naming what is wrong."""
    if draft_probs.dim() != 3 or draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs and target_probs must both be [batch, window, vocab]; got "
            f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}"
        )
    if draft_tokens.shape != draft_probs.shape[:2]:
        raise ValueError(
            f"draft_tokens must be [batch, window] = {tuple(draft_probs.shape[:2])}, "
            f"got {tuple(draft_tokens.shape)}"
        )
    if draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    vocab = draft_probs.shape[-1]
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(
            f"draft_tokens must lie in [0, {vocab}), got values in "
            f"[{int(draft_tokens.min())}, {int(draft_tokens.max())}]"
        )
    for name, probs in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not torch.isfinite(probs).all():
            raise ValueError(f"{name} contains NaN or inf")


@dataclass(frozen=True)
class AcceptanceRule:
    """Decides, per window slot, how likely a draft token is to be kept, and where to resample.

    Subclasses override `acceptance_probs` (and `residual_probs` where their paper changes it).
    `lossless` rules leave the output distribution exactly the autoregressive one.
    """

    name: ClassVar[str] = "sjd"
    lossless: ClassVar[bool] = True
    # Model data a rule needs, passed to its constructor by the loop: "token_embeddings" or
    # "codebook" (each [vocab, dim]).
    needs: ClassVar[tuple[str, ...]] = ()
    residual_needs_tokens: ClassVar[bool] = False

    @property
    def exact(self) -> bool:
        """Whether this rule with these options leaves the output law the autoregressive one:
        a lossless rule, or a relaxed one at zero relaxation (csd with lam = 0 or delta = 0,
        amplify k = 1, addition eps = 0, gsd group_size = 1, lantern delta = 0). The loop
        verifies exact rules by Gumbel-max match (decoding/verify.py)."""
        return self.lossless

    def compute_acceptance(
        self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
    ) -> torch.Tensor:
        """The rule's math without input checks (the decoding loop's hot path). -> [B, K]."""
        return Fn.acceptance_ratio(draft_tokens, draft_probs, target_probs).clamp(max=1.0)

    def supported_acceptance(
        self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
    ) -> torch.Tensor:
        """compute_acceptance, but 0 for a draft the target gives probability 0 (a structural
        id inside an image row, a token outside top-k / top-p): what the loop verifies with.
        The lossless rule gives such a draft 0 already; the relaxed formulas (an added eps or
        lam * H, a group's or neighbours' mass) would keep it, and a token the sampling setup
        forbids is never a sample of the target, however relaxed. -> [B, K]."""
        accept = self.compute_acceptance(draft_tokens, draft_probs, target_probs)
        allowed = target_probs.gather(-1, draft_tokens[..., None])[..., 0] > 0
        return torch.where(allowed, accept, torch.zeros_like(accept))

    def compute_residual(
        self,
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        draft_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Resampling distribution without input checks. -> [B, K, V]."""
        return Fn.residual_probs(draft_probs, target_probs)

    def acceptance_probs(
        self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
    ) -> torch.Tensor:
        """draft_tokens [B, K] int64; draft_probs, target_probs [B, K, V] (rows sum to 1)
        -> probability of keeping each draft, [B, K] in [0, 1]. Checks its inputs."""
        check_inputs(draft_tokens, draft_probs, target_probs)
        return self.supported_acceptance(draft_tokens, draft_probs, target_probs)

    def residual_probs(
        self,
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        draft_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Where to resample after a rejection: [B, K, V] -> [B, K, V], rows sum to 1.

        `draft_tokens` [B, K] is needed only by rules whose residual depends on the token
        (lantern). Checks its inputs.
        """
        if draft_tokens is None:
            if self.residual_needs_tokens:
                raise ValueError(
                    f"{self.name}'s residual depends on the draft token; pass draft_tokens"
                )
            draft_tokens = torch.zeros(
                draft_probs.shape[:2], dtype=torch.long, device=draft_probs.device
            )
        check_inputs(draft_tokens, draft_probs, target_probs)
        return self.compute_residual(draft_probs, target_probs, draft_tokens)


def check_nonnegative(name: str, value: float) -> None:
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_unit(name: str, value: float) -> None:
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
