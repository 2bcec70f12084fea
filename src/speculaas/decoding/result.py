"""What a decode returns, and the per-image random streams both loops draw from."""

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
    0, 1, ..., W - 1 drafts. rule_seconds: time spent inside the acceptance rule.
    mean_window [B]: mean window each image got (the window policy may vary it).
    """

    tokens: torch.Tensor
    forward_passes: torch.Tensor
    commit_step: torch.Tensor
    drafted: torch.Tensor
    entropy: torch.Tensor
    accept_hist: torch.Tensor
    iterations: int
    rule_seconds: float = 0.0
    mean_window: torch.Tensor | None = None

    @classmethod
    def concat(cls, parts: list[DecodeResult]) -> DecodeResult:
        """One result for images decoded in consecutive chunks."""
        if len(parts) == 1:
            return parts[0]

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return cls(tokens=cat("tokens"), forward_passes=cat("forward_passes"),
                   commit_step=cat("commit_step"), drafted=cat("drafted"),
                   entropy=cat("entropy"), accept_hist=cat("accept_hist"),
                   iterations=sum(p.iterations for p in parts),
                   rule_seconds=sum(p.rule_seconds for p in parts),
                   mean_window=cat("mean_window"))


class Commits:
    """What both Jacobi loops record per generated position, with one spare column `dump` at the
    end that absorbs the writes of slots that commit nothing: the token, the iteration that
    committed it (-1: not yet), whether it was an accepted draft, and the target's entropy."""

    def __init__(self, batch: int, dump: int, device: torch.device) -> None:
        self.dump = dump
        self.tokens = torch.zeros(batch, dump + 1, dtype=torch.long, device=device)
        self.step = torch.full((batch, dump + 1), -1, dtype=torch.long, device=device)
        self.drafted = torch.zeros(batch, dump + 1, dtype=torch.bool, device=device)
        self.entropy = torch.zeros(batch, dump + 1, device=device)

    def write(self, images: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor,
              tokens: torch.Tensor, iteration: int, drafted: torch.Tensor,
              target_probs: torch.Tensor) -> None:
        """Commit tokens [b, L] at positions pos [b, L] of images [b] where keep [b, L]."""
        from ..acceptance.functional import entropy

        rows, cols = images[:, None], torch.where(keep, pos, self.dump)
        self.tokens[rows, cols] = tokens
        self.step[rows, cols] = iteration
        self.drafted[rows, cols] = drafted
        self.entropy[rows, cols] = entropy(target_probs)

    def result(self, length: int, **counts) -> DecodeResult:  # noqa: ANN003
        """The DecodeResult of the first `length` positions; counts: its remaining fields."""
        return DecodeResult(tokens=self.tokens[:, :length], commit_step=self.step[:, :length],
                            drafted=self.drafted[:, :length],
                            entropy=self.entropy[:, :length], **counts)


def draw(generators: list[torch.Generator], rows: torch.Tensor, count: int,
         device: torch.device) -> torch.Tensor:
    """[len(rows), count] uniforms, row i from the generator of image rows[i].

    Every active image draws the same count each iteration whatever the others do, so an
    image's random stream, and hence its output, does not depend on its batch.
    """
    return torch.stack([torch.rand(count, generator=generators[i], device=device)
                        for i in rows.tolist()])


def draw_ragged(generators: list[torch.Generator], rows: torch.Tensor, counts: torch.Tensor,
                device: torch.device) -> torch.Tensor:
    """[len(rows), max(counts)] uniforms, row i holding counts[i] draws from the generator of
    image rows[i] (zeros after them): an image's stream depends only on its own needs."""
    n = counts.tolist()
    out = torch.zeros(len(n), max(n), device=device)
    for i, (g, k) in enumerate(zip(rows.tolist(), n, strict=True)):
        if k:
            out[i, :k] = torch.rand(k, generator=generators[g], device=device)
    return out
