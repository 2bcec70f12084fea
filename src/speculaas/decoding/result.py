"""What a decode returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeResult:
    """Per-image record of one decode. B images, T generated positions, W window.

    tokens [B, T]: generated tokens. forward_passes [B]: target forwards that worked on each
    image (prefill not counted, so AR spends exactly T). commit_step [B, T]: iteration that
    committed each position. drafted [B, T] bool: committed as an accepted draft (rather than
    sampled by the target at that iteration). entropy [B, T]: entropy (nats) of the target
    distribution that decided each position. accept_hist [B, W]: how many iterations accepted
    0, 1, ..., W - 1 drafts. rule_seconds: time spent inside the acceptance rule;
    head_seconds: inside a trained draft head's chain (both measured with `profile`).
    window_hist [B, W + 1]: forwards that ran each image with each window (the window policy
    may vary it; AR: all at window 1).
    """

    tokens: torch.Tensor
    forward_passes: torch.Tensor
    commit_step: torch.Tensor
    drafted: torch.Tensor
    entropy: torch.Tensor
    accept_hist: torch.Tensor
    iterations: int
    rule_seconds: float = 0.0
    window_hist: torch.Tensor | None = None
    head_seconds: float = 0.0

    @property
    def mean_window(self) -> torch.Tensor:
        """[B] mean window each image got."""
        if self.window_hist is None:
            return torch.ones(self.tokens.shape[0], device=self.tokens.device)
        w = torch.arange(self.window_hist.shape[1], device=self.window_hist.device)
        return (self.window_hist * w).sum(1) / self.window_hist.sum(1).clamp(min=1)

    @classmethod
    def concat(cls, parts: list[DecodeResult]) -> DecodeResult:
        """One result for images decoded in consecutive chunks."""
        if len(parts) == 1:
            return parts[0]

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            if values[0] is None:
                return None
            width = max(v.shape[-1] for v in values)  # histograms of different windows
            return torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[-1]))
                              if v.dim() == 2 and name.endswith("hist") else v for v in values])

        return cls(tokens=cat("tokens"), forward_passes=cat("forward_passes"),
                   commit_step=cat("commit_step"), drafted=cat("drafted"),
                   entropy=cat("entropy"), accept_hist=cat("accept_hist"),
                   iterations=sum(p.iterations for p in parts),
                   rule_seconds=sum(p.rule_seconds for p in parts),
                   head_seconds=sum(p.head_seconds for p in parts),
                   window_hist=cat("window_hist"))
