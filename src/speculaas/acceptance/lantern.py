"""LANTERN: relaxed acceptance by latent proximity (Jang et al., "LANTERN: Accelerating Visual
Autoregressive Models with Relaxed Speculative Decoding", ICLR 2025, Eq. 5-6), applied to Jacobi
drafts instead of a trained drafter.

The draft x borrows the target mass of its nearest codebook neighbours n_1, n_2, ... (nearest
first, at most k of them) while the borrowed mass stays within a total-variation budget delta:

    m = max{ j <= k : sum_{i<=j} target(n_i) <= delta },
    q~ = target with the mass of n_1..n_m moved onto x,     b = min(1, q~(x) / draft(x)).

On rejection we resample from norm(max(0, q~ - draft)). That makes the output at each position
exactly q~, whose TV distance to the target is at most delta. (LANTERN's code zeroes k + 1
neighbours instead of the m it merged; we keep the consistent residual.)

k >= 1 neighbours (clipped to vocab - 1), delta in [0, 1] (0 is SJD).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import functional as Fn
from .base import AcceptanceRule, check_unit, is_integer


def neighbour_table(codebook: torch.Tensor, k: int, chunk: int = 2048) -> torch.Tensor:
    """[V, d] codes -> [V, min(k, V-1)] indices of each code's nearest other codes (L2)."""
    codebook = codebook.float()
    k = min(k, codebook.shape[0] - 1)
    rows = []
    for start in range(0, codebook.shape[0], chunk):
        d = torch.cdist(codebook[start : start + chunk], codebook)
        d[torch.arange(d.shape[0]), torch.arange(start, start + d.shape[0])] = float("inf")
        rows.append(d.topk(k, dim=-1, largest=False).indices)
    return torch.cat(rows)


@dataclass(frozen=True)
class Lantern(AcceptanceRule):
    name = "lantern"
    lossless = False
    needs = ("codebook",)
    residual_needs_tokens = True
    k: int = 100
    delta: float = 0.1
    codebook: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _table: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_integer(self.k) or not 1 <= self.k <= 1024:
            raise ValueError(f"lantern k must be an integer in [1, 1024], got {self.k!r}")
        check_unit("delta", self.delta)
        if self.codebook is None:
            raise ValueError(
                "lantern needs the model's codebook (codebook=[vocab, dim]); "
                "this model provides none"
            )
        object.__setattr__(self, "_table", neighbour_table(self.codebook, int(self.k)))

    @property
    def exact(self) -> bool:
        return self.delta == 0

    def _merge(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor):
        """-> neighbour ids [B, K, k], their target mass [B, K, k], which are merged [B, K, k]."""
        table = self._table.to(draft_tokens.device)
        # Tokens past the codebook (structural ones such as end-of-line) have no neighbours.
        has_code = (draft_tokens < table.shape[0]).unsqueeze(-1)
        neigh = table[draft_tokens.clamp(max=table.shape[0] - 1)]
        mass = target_probs.gather(-1, neigh)
        merged = (mass.cumsum(-1) <= self.delta) & has_code  # cumulative mass: a prefix
        return neigh, mass, merged

    def compute_acceptance(self, draft_tokens, draft_probs, target_probs):  # noqa: ANN001, ANN201
        _, mass, merged = self._merge(draft_tokens, target_probs)
        relaxed = Fn.gather_token(target_probs, draft_tokens) + (mass * merged).sum(-1)
        return (relaxed / Fn.gather_token(draft_probs, draft_tokens).clamp_min(1e-12)).clamp(
            max=1.0
        )

    def compute_residual(self, draft_probs, target_probs, draft_tokens=None):  # noqa: ANN001, ANN201
        neigh, mass, merged = self._merge(draft_tokens, target_probs)
        relaxed = target_probs.scatter(-1, neigh, torch.where(merged, 0.0, mass))
        relaxed = relaxed.scatter_add(
            -1, draft_tokens.unsqueeze(-1), (mass * merged).sum(-1, keepdim=True)
        )
        return Fn.residual_probs(draft_probs, relaxed)
