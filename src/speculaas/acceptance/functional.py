"""Pure tensor functions behind every acceptance rule.

Shapes: B = batch, K = verified window slots, V = vocabulary.
`draft_probs` is the distribution a draft token was actually sampled from; `target_probs` is the
target model's distribution at the same position (after CFG and warping).
"""

from __future__ import annotations

import torch

# Smallest draft probability we divide by. A draft token always has draft_probs > 0 (it was
# sampled from it); the clamp only keeps padded or masked slots from producing inf/NaN.
_EPS = 1e-12


def gather_token(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [B, K, V], tokens [B, K] -> probs[b, k, tokens[b, k]] as [B, K]."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def acceptance_ratio(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    """target(x) / draft(x) for each draft token x, unclipped. -> [B, K]."""
    return gather_token(target_probs, draft_tokens) / gather_token(
        draft_probs, draft_tokens
    ).clamp_min(_EPS)


def residual_probs(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)): where to resample after a rejection. [..., V] -> [..., V].

    Guard: when target == draft (to rounding) the residual is all zero; a rejection is then
    impossible in exact arithmetic, and the target itself is the right fallback.
    """
    res = (target_probs - draft_probs).clamp_min(0.0)
    total = res.sum(-1, keepdim=True)
    empty = total <= 1e-9
    return torch.where(empty, target_probs, res / torch.where(empty, torch.ones_like(total), total))


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats (not normalised by log V, as the CSD code). [..., V] -> [...]."""
    return -(probs * probs.clamp_min(1e-10).log()).sum(-1)


def total_variation(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """0.5 * sum |draft - target|, computed as 1 - sum min(draft, target) (equal for rows that
    sum to 1), which is exactly 1 for disjoint supports: the half-sum of differences rounded
    to 0.99999976 there, below a threshold delta = 1. [..., V] -> [...] in [0, 1]."""
    return (1 - torch.minimum(draft_probs, target_probs).sum(-1)).clamp(0.0, 1.0)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats, with 0 log 0 = 0 and q clamped away from zero. [..., V] -> [...]."""
    return (p * (p.clamp_min(1e-10).log() - q.clamp_min(1e-10).log())).sum(-1)


def first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """accepted [B, K] bool -> [B] index of the first False (K when every slot is accepted)."""
    return accepted.long().cumprod(-1).sum(-1)
