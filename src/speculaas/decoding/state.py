"""DecodeState: every per-image tensor of one decode, and the named layout of its random streams.

Everything is indexed by image (the batch row) and, where it varies along the image, by
generated position, so the decoding order (raster, several rows, later trees) is only a choice of
which positions each image runs next (frontier.py). B images, T generated positions, V
vocabulary, R draft slots kept per image (frontier-chosen: a window's worth in raster order,
the whole image when several rows draft at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..acceptance.functional import entropy
from ..sampling import exponential_noise, image_keys
from .result import DecodeResult

# Under this size a decode computes its images' noise of every position once (a table) instead
# of hashing each window's positions every iteration (a position sits in several windows before
# it commits). Either way the values are the same; only the memory and the time differ.
NOISE_TABLE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Uniforms:
    """The uniforms of one verified segment of up to `window` slots, by use ([G, window] each,
    extra [G]). Every verified segment of an image takes one block of `count(window)` from the
    image's own stream, so the stream does not depend on the batch.

    accept: the test of draft slot j (reused by a coupling's keep-or-redraw of tail slot j,
        whose verification decided nothing). redraw: the coupling's new token at tail slot j.
    extra: the token committed after the accepted drafts (residual or bonus). fresh: the
        fresh-slot initialiser's token at slot j.
    """

    accept: torch.Tensor
    redraw: torch.Tensor
    extra: torch.Tensor
    fresh: torch.Tensor

    @staticmethod
    def count(window: int) -> int:
        return 3 * window + 1

    @classmethod
    def split(cls, block: torch.Tensor, window: int) -> Uniforms:
        """[G, count(window)] -> the four uses."""
        w = window
        return cls(block[:, :w], block[:, w : 2 * w], block[:, 2 * w], block[:, 2 * w + 1 :])

    def take(self, rows: torch.Tensor) -> Uniforms:
        """The blocks of rows [G] (several segments of a plan may share an unused block)."""
        return Uniforms(self.accept[rows], self.redraw[rows], self.extra[rows], self.fresh[rows])


@dataclass
class DecodeState:
    """One decode's per-image record.

    tokens, step, drafted, entropy [B, T + 1]: per generated position the committed token, the
    iteration that committed it (-1: not yet), whether it was an accepted draft, and the entropy
    of the target that decided it; column T absorbs writes of slots that commit nothing.
    count [B]: committed positions. draft_tokens [B, R + 1], draft_laws [B, R + 1, V],
    has_draft [B, R + 1]: the drafts waiting for verification, at column position % R (column R
    absorbs writes); a draft's law is the distribution it was drawn from. forward_passes [B],
    accept_hist [B, W] (iterations that accepted 0 .. W - 1 drafts), window_hist [B, W + 1]
    (forwards that ran each image with each window). memory:
    per-image tensors of the other parts (a drafter's ring of targets, which keys the cache
    holds in two-dimensional order), each [B, ...], named by their owner.
    generators: one random stream per image.
    """

    length: int
    vocab: int
    generators: list[torch.Generator]
    tokens: torch.Tensor
    step: torch.Tensor
    drafted: torch.Tensor
    entropy: torch.Tensor
    count: torch.Tensor
    draft_tokens: torch.Tensor
    draft_laws: torch.Tensor
    has_draft: torch.Tensor
    forward_passes: torch.Tensor
    accept_hist: torch.Tensor
    window_hist: torch.Tensor
    keys: torch.Tensor
    iteration: int = 0
    rule_seconds: float = 0.0
    head_seconds: float = 0.0
    memory: dict[str, torch.Tensor] = field(default_factory=dict)
    noise_table: torch.Tensor | None = None

    @classmethod
    def new(cls, generators: list[torch.Generator], length: int, vocab: int, ring: int,
            max_window: int, device: torch.device, dtype: torch.dtype = torch.float32,
            ) -> DecodeState:
        b = len(generators)
        keys = image_keys(generators, device)  # first: the same draw AR decoding makes

        def zeros(*shape: int, **kw) -> torch.Tensor:  # noqa: ANN003
            return torch.zeros(*shape, device=device, **kw)

        return cls(length=length, vocab=vocab, generators=generators,
                   tokens=zeros(b, length + 1, dtype=torch.long),
                   step=torch.full((b, length + 1), -1, dtype=torch.long, device=device),
                   drafted=zeros(b, length + 1, dtype=torch.bool), entropy=zeros(b, length + 1),
                   count=zeros(b, dtype=torch.long),
                   draft_tokens=zeros(b, ring + 1, dtype=torch.long),
                   draft_laws=zeros(b, ring + 1, vocab, dtype=dtype),
                   has_draft=zeros(b, ring + 1, dtype=torch.bool),
                   forward_passes=zeros(b, dtype=torch.long),
                   accept_hist=zeros(b, max_window, dtype=torch.long),
                   window_hist=zeros(b, max_window + 1, dtype=torch.long), keys=keys)

    @property
    def batch(self) -> int:
        return len(self.generators)

    @property
    def ring(self) -> int:
        return self.draft_tokens.shape[1] - 1

    def committed_prefix(self, start: int) -> None:
        """Mark positions 0 .. start - 1 committed (token 0) for every image: a state that looks
        half-way through its images, for timing an iteration."""
        self.step[:, :start] = 0
        self.count.fill_(start)

    def restart(self, rows: list[int], generators: list[torch.Generator]) -> None:
        """Continuous batching: rows `rows` start new images with these random streams, drawn
        from exactly as a decode of their own draws (the noise key first), so that an image's
        tokens do not depend on when it joined the batch. `retire` marks rows finished."""
        idx = torch.tensor(rows, device=self.count.device)
        for r, g in zip(rows, generators, strict=True):
            self.generators[r] = g
        self.keys[idx] = image_keys(generators, self.count.device)
        for t in (self.tokens, self.drafted, self.entropy, self.count, self.has_draft,
                  self.forward_passes, self.accept_hist, self.window_hist):
            t[idx] = 0
        self.step[idx] = -1
        if self.noise_table is not None:
            for r in rows:
                self.noise_table[r] = self._noise_row(r)

    def retire(self, rows: list[int]) -> None:
        """Rows that hold no image (free slots of a continuous batch): finished for the loop."""
        self.count[torch.tensor(rows, device=self.count.device)] = self.length

    def noise(self, img: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The exponential noise (sampling.exponential_noise) of images img [G] at positions
        pos [G, L]: [G, L, V] float32; from a table of every position when it fits in
        NOISE_TABLE_BYTES (slots past the image end, never committed, read its last row)."""
        if self.noise_table is not None:
            return self.noise_table[img[:, None], pos.clamp(max=self.length - 1)]
        return exponential_noise(self.keys[img], pos, self.vocab)

    def tabulate_noise(self) -> None:
        """Compute the noise table now if it fits (the loop does, before its first step)."""
        if self.batch * self.length * self.vocab * 4 <= NOISE_TABLE_BYTES:
            self.noise_table = torch.stack([self._noise_row(i) for i in range(self.batch)])

    def _noise_row(self, image: int) -> torch.Tensor:
        """[T, V]: the noise of every position of one image (a row of the table)."""
        every = torch.arange(self.length, device=self.keys.device)[None]
        return exponential_noise(self.keys[image : image + 1], every, self.vocab)[0]

    def uniforms(self, images: list[int], segments: list[int], window: int) -> Uniforms:
        """One block per verified segment, image-major: image images[i] draws segments[i]
        blocks from its own stream in one call. -> Uniforms over sum(segments) rows."""
        per = Uniforms.count(window)
        dev = self.count.device
        blocks = [torch.rand(k * per, generator=self.generators[i], device=dev).view(k, per)
                  for i, k in zip(images, segments, strict=True) if k]
        return Uniforms.split(torch.cat(blocks), window)

    # Drafts, by position. ---------------------------------------------------------------------

    def _column(self, pos: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        col = pos.remainder(self.ring)
        return col if where is None else torch.where(where, col, self.ring)

    def drafts_at(self, img: torch.Tensor, pos: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts waiting at positions pos [G, K] of images img [G]: tokens [G, K], laws
        [G, K, V], and how many leading positions hold one [G] (the rest are fresh slots)."""
        col = self._column(pos)
        rows = img[:, None]
        has = self.has_draft[rows, col] & (pos < self.length)
        return (self.draft_tokens[rows, col], self.draft_laws[rows, col],
                has.long().cumprod(1).sum(1))

    def keep_drafts(self, img: torch.Tensor, pos: torch.Tensor, where: torch.Tensor,
                    tokens: torch.Tensor, laws: torch.Tensor) -> None:
        """Store the next drafts tokens [G, L] with their laws [G, L, V] at pos [G, L] where
        `where` [G, L]."""
        col, rows = self._column(pos, where), img[:, None]
        self.draft_tokens[rows, col] = tokens
        self.draft_laws[rows, col] = laws
        self.has_draft[rows, col] = True
        self.has_draft[:, self.ring] = False

    # Commits. ---------------------------------------------------------------------------------

    def commit(self, img: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor,
               tokens: torch.Tensor, drafted: torch.Tensor, target_probs: torch.Tensor) -> None:
        """Commit tokens [G, L] at positions pos [G, L] of images img [G] where keep [G, L];
        drafted [G, L]: accepted drafts; target_probs [G, L, V]: what decided them."""
        rows, cols = img[:, None], torch.where(keep, pos, self.length)
        self.tokens[rows, cols] = tokens
        self.step[rows, cols] = self.iteration
        self.drafted[rows, cols] = drafted
        self.entropy[rows, cols] = entropy(target_probs)
        self.count.index_add_(0, img, keep.sum(1))
        self.has_draft[rows, self._column(pos, keep)] = False  # a committed draft is used up
        self.has_draft[:, self.ring] = False

    def ran(self, images: torch.Tensor, window: int) -> None:
        """Count one forward with `window` slots for each of images [b] (each at most once)."""
        self.forward_passes.index_add_(0, images, torch.ones_like(images))
        self.window_hist[images, window] += 1

    def result(self) -> DecodeResult:
        n = self.length
        return DecodeResult(tokens=self.tokens[:, :n], forward_passes=self.forward_passes,
                            commit_step=self.step[:, :n], drafted=self.drafted[:, :n],
                            entropy=self.entropy[:, :n], accept_hist=self.accept_hist,
                            iterations=self.iteration, rule_seconds=self.rule_seconds,
                            head_seconds=self.head_seconds,
                            window_hist=self.window_hist)
