"""Grouped Speculative Decoding (So et al., "Grouped Speculative Decoding for Autoregressive
Image Generation", ICCV 2025; junhyukso/GSD).

The draft token x is accepted as a member of a group G(x) of interchangeable tokens:

    b = min(1, sum_{y in G(x)} target(y) / sum_{y in G(x)} draft(y)).

G(x) holds the tokens ranked within +-(group_size - 1) // 2 places of x in the target
distribution (a dynamic cluster) that also satisfy |target(y) - target(x)| < prob_threshold and,
when token embeddings are given, ||e_y - e_x||^2 < dist_threshold (a static cluster, in the
model's token-embedding space as GSD's code does). x itself is always in G(x). The committed
token is x; the residual stays norm(max(0, target - draft)), so GSD is lossy.

group_size >= 1 (1 is SJD); prob_threshold, dist_threshold >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import functional as Fn
from .base import AcceptanceRule, check_nonnegative, is_integer

# Wider than any image vocabulary supported here (Emu3: 32,768 codes): a larger group means
# nothing more and would only allocate.
MAX_GROUP = 65_537


@dataclass(frozen=True)
class GSD(AcceptanceRule):
    name = "gsd"
    lossless = False
    needs = ("token_embeddings",)
    group_size: int = 15
    prob_threshold: float = 0.15
    dist_threshold: float = 0.5
    token_embeddings: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_integer(self.group_size) or not 1 <= self.group_size <= MAX_GROUP:
            raise ValueError(f"gsd group_size must be an integer in [1, {MAX_GROUP}], got "
                             f"{self.group_size!r}")
        check_nonnegative("prob_threshold", self.prob_threshold)
        check_nonnegative("dist_threshold", self.dist_threshold)

    @property
    def exact(self) -> bool:
        return self.group_size == 1

    def compute_acceptance(self, draft_tokens, draft_probs, target_probs):  # noqa: ANN001, ANN201
        vocab = target_probs.shape[-1]
        half = (int(self.group_size) - 1) // 2
        order = target_probs.argsort(dim=-1, descending=True)  # [B, K, V] tokens by rank
        ranks = torch.empty_like(order).scatter_(
            -1, order, torch.arange(vocab, device=order.device).expand_as(order))
        offsets = torch.arange(-half, half + 1, device=order.device)  # [G]
        cand_rank = ranks.gather(-1, draft_tokens.unsqueeze(-1)) + offsets  # [B, K, G]
        valid = (cand_rank >= 0) & (cand_rank < vocab)
        cand = order.gather(-1, cand_rank.clamp(0, vocab - 1))  # [B, K, G] token ids
        tq, dq = target_probs.gather(-1, cand), draft_probs.gather(-1, cand)
        tx = Fn.gather_token(target_probs, draft_tokens).unsqueeze(-1)
        keep = valid & ((tq - tx).abs() < self.prob_threshold)
        if self.token_embeddings is not None:
            emb = self.token_embeddings.to(target_probs.device, torch.float32)
            dist = (emb[cand] - emb[draft_tokens].unsqueeze(-2)).pow(2).sum(-1)
            keep &= dist < self.dist_threshold
        keep |= offsets == 0  # x belongs to its own group whatever the filters say
        ratio = (tq * keep).sum(-1) / (dq * keep).sum(-1).clamp_min(1e-12)
        return ratio.clamp(max=1.0)
