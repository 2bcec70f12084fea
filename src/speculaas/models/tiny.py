"""Test models with random weights: `tiny` (a small class-conditional transformer) and `toy`
(a lookup table over every prefix, whose exact joint distribution can be enumerated)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from PIL import Image

from ..config import SamplingConfig
from ..sampling import target_probs
from .base import (
    DraftIO,
    ImageModel,
    Layout,
    PrefixDecoderSession,
    Session,
    decoder_draft_io,
    weights_fingerprint,
)
from .transformer import Decoder, DecoderConfig


def _palette(n: int) -> np.ndarray:
    rng = np.random.default_rng(1234)
    return rng.integers(0, 256, size=(n, 3), dtype=np.uint8)


def _paint(cells: torch.Tensor, grid: tuple[int, int], n_colours: int, px: int = 8) -> list:
    pal = _palette(n_colours)
    rows, cols = grid
    out = []
    for row in cells.cpu().numpy():
        img = pal[row].reshape(rows, cols, 3).repeat(px, 0).repeat(px, 1)
        out.append(Image.fromarray(img))
    return out


def _check_grid(grid) -> tuple[int, int]:  # noqa: ANN001
    if (
        not isinstance(grid, (tuple, list))
        or len(grid) != 2
        or any(int(g) != g or g < 1 for g in grid)
    ):
        raise ValueError(f"grid must be (rows, cols) of positive integers, got {grid!r}")
    return int(grid[0]), int(grid[1])


class TinyModel(ImageModel):
    """A small randomly initialised decoder, optionally class-conditional with CFG.

    Prompts are class ids in [0, num_classes) or None (unconditional). Input ids: classes, then
    the null class, then the image-start token, then image tokens. With `row_end=True` every
    row of the grid ends with a forced end-of-row token (id vocab_size in the distributions).
    """

    name = "tiny"
    packed_forward = True

    def __init__(
        self,
        vocab_size: int = 16,
        grid: tuple[int, int] = (4, 4),
        seed: int = 0,
        num_classes: int = 10,
        d_model: int = 32,
        n_layers: int = 2,
        n_heads: int = 4,
        row_end: bool = False,
        logit_scale: float = 0.5,
        cfg_scale: float | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if int(vocab_size) != vocab_size or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
        rows, cols = _check_grid(grid)
        self.image_vocab = int(vocab_size)
        self.num_classes = int(num_classes)
        self.vocab_size = self.image_vocab + (1 if row_end else 0)
        self.layout = (
            Layout.with_row_end(rows, cols, self.image_vocab)
            if row_end
            else Layout.raster(rows, cols)
        )
        self.defaults = SamplingConfig(cfg_scale=cfg_scale)
        self.device = torch.device(device)
        self._special = self.num_classes + 2  # classes, null, image start
        torch_gen = torch.Generator().manual_seed(seed)
        cfg = DecoderConfig(
            vocab_in=self._special + self.vocab_size,
            vocab_out=self.vocab_size,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            max_len=4 + self.layout.length,  # two spare positions (base.packed_layout)
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=torch_gen)))
            self.decoder = Decoder(cfg)
            # Peaked output distributions, so acceptance differs from slot to slot.
            torch.nn.init.normal_(self.decoder.head.weight, std=logit_scale)
        self.decoder.to(self.device).eval()

    def _prefix(self, prompts: list, null: bool) -> torch.Tensor:
        ids = []
        for p in prompts:
            if p is not None and (
                isinstance(p, bool)
                or not isinstance(p, (int, np.integer))
                or not 0 <= p < self.num_classes
            ):
                raise ValueError(
                    f"tiny model prompts are class ids in [0, {self.num_classes}) "
                    f"or None, got {p!r}"
                )
            cls = self.num_classes if (p is None or null) else int(p)
            ids.append([cls, self.num_classes + 1])
        return torch.tensor(ids, device=self.device)

    def check_prompts(self, prompts: list) -> None:
        self._prefix(prompts, null=False)

    def admit(self, session, rows: list[int], prompts: list) -> None:  # noqa: ANN001
        session.admit(rows, self._prefix(prompts, null=False),
                      self._prefix(prompts, null=True) if session.cfg else None)

    def start(self, prompts: list, *, cfg: bool) -> Session:
        null = self._prefix(prompts, null=True) if cfg else None
        return PrefixDecoderSession(
            self.decoder, self._prefix(prompts, null=False), null, token_offset=self._special
        )

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        return _paint(self.layout.image_tokens(tokens), self.grid, self.vocab_size)

    def token_embeddings(self) -> torch.Tensor:
        return self.decoder.embed.weight[self._special :].detach()

    def draft_io(self) -> DraftIO:
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = weights_fingerprint(self.name, self.decoder)
        return decoder_draft_io(self.decoder, self._special, self._fingerprint)

    def codebook(self) -> torch.Tensor:
        # Random weights have no VQ codebook; the output-head rows stand in for one.
        return self.decoder.head.weight.detach()


class ToyModel(ImageModel):
    """Unconditional model defined by a table of logits for every prefix of a short sequence.

    With vocab V and length T there are V**T sequences, so the exact distribution of any
    sampling configuration can be enumerated (`exact_distribution`) and compared with samples.
    `rows` lays the T positions out as a rows x (T / rows) grid (for drafters that look one row
    up). A second table is the unconditional branch, so CFG (`cfg_scale`) can be tested too.
    """

    name = "toy"

    def __init__(
        self,
        vocab_size: int = 3,
        length: int = 4,
        seed: int = 0,
        scale: float = 1.5,
        rows: int = 1,
        device: str | torch.device = "cpu",
        packed: bool = False,
    ) -> None:
        self.packed_forward = bool(packed)  # sessions then take packed windows (trees)
        if vocab_size**length > 100_000:
            raise ValueError(
                f"toy model with vocab {vocab_size} and length {length} has too "
                "many sequences to enumerate (limit 100000)"
            )
        self.vocab_size = int(vocab_size)
        self.length = int(length)
        if rows < 1 or self.length % rows:
            raise ValueError(f"toy model: rows={rows!r} must divide length {self.length}")
        self.layout = Layout.raster(rows, self.length // rows)
        self.defaults = SamplingConfig()
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        n_prefixes = sum(vocab_size**t for t in range(length))
        self.table = (scale * torch.randn(n_prefixes, vocab_size, generator=gen)).to(self.device)
        self.uncond_table = (scale * torch.randn(n_prefixes, vocab_size, generator=gen)).to(
            self.device)
        # Row of the table for a prefix of length t: (V**t - 1) / (V - 1) + its base-V value.
        self._base = [(vocab_size**t - 1) // (vocab_size - 1) for t in range(length + 1)]

    def prefix_index(self, seqs: torch.Tensor, upto: torch.Tensor) -> torch.Tensor:
        """seqs [R, >=T], upto [R, L] prefix lengths -> table rows [R, L]."""
        value = torch.zeros_like(upto)
        for t in range(self.length):
            take = upto > t
            value = torch.where(take, value * self.vocab_size + seqs[:, t : t + 1], value)
        base = torch.tensor(self._base, device=upto.device)[upto.clamp(max=self.length - 1)]
        return base + value

    def start(self, prompts: list, *, cfg: bool) -> Session:
        if any(p is not None for p in prompts):
            raise ValueError("the toy model is unconditional; pass None prompts")
        return _ToySession(self, len(prompts), cfg)

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        return _paint(tokens, self.grid, self.vocab_size)

    def draft_io(self) -> DraftIO:
        """Features are the table's logits themselves, tokens embed one-hot: a draft head on
        the toy is a small network from logits to logits, which keeps exact distributions."""
        eye = torch.eye(self.vocab_size, device=self.device)
        digest = weights_fingerprint(self.name, torch.nn.ParameterList(
            [torch.nn.Parameter(self.table, requires_grad=False)]))
        return DraftIO(dim=self.vocab_size, embed=lambda tokens: eye[tokens],
                       logits=torch.nn.Identity(), fingerprint=digest)

    def exact_distribution(self, sampling: SamplingConfig | None = None) -> dict[tuple, float]:
        """Probability of every complete sequence under AR sampling with `sampling`."""
        sampling = sampling or self.defaults
        seqs = torch.tensor(
            list(itertools.product(range(self.vocab_size), repeat=self.length)), device=self.device
        )
        upto = torch.arange(self.length, device=self.device).expand(len(seqs), -1)
        rows = self.prefix_index(seqs, upto)
        uncond = self.uncond_table[rows] if sampling.uses_cfg else None
        probs = target_probs(self.table[rows], uncond, sampling)
        p = probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)
        return {tuple(s.tolist()): float(v) for s, v in zip(seqs, p, strict=True)}


class _ToySession(Session):
    def __init__(self, model: ToyModel, batch: int, cfg: bool) -> None:
        self.model, self.cfg = model, cfg
        self.batch_size = batch
        self.seqs = torch.zeros(batch, model.length + 64, dtype=torch.long, device=model.device)

    def forward(self, inputs, offset, images, max_offset=None):  # noqa: ANN001, ANN201
        length = inputs.shape[1]
        pos = offset[:, None] - 1 + torch.arange(length, device=inputs.device)  # [b, L]
        write = (pos >= 0).to(inputs.dtype)
        cols = pos.clamp(min=0, max=self.seqs.shape[1] - 1)
        old = self.seqs[images[:, None], cols]
        self.seqs[images[:, None], cols] = write * inputs + (1 - write) * old
        rows = self.model.prefix_index(
            self.seqs[images], (pos + 1).clamp(max=self.model.length - 1)
        )
        out = self.model.table[rows], self.model.uncond_table[rows] if self.cfg else None
        if self.record_features:  # the logits are the features (ToyModel.draft_io)
            self.features = out
        return out

    def forward_packed(self, inputs, pos, images, visible, window_mask, store, scratch=0):  # noqa: ANN001, ANN201, E501
        """Session.forward_packed for a table model: slot s's context is the cached sequence
        where `visible` allows it, with the inputs of the window slots it sees at their
        positions (a hidden cached position reads as token 0: the toy has no other notion of
        a missing key)."""
        if not self.model.packed_forward:
            raise NotImplementedError("toy model built without packed=True")
        b, n, length = inputs.shape[0], inputs.shape[1], self.model.length
        ctx = self.seqs[images, None, :length].expand(b, n, length).clone()
        # Column c of visible is position c - 1; position T - 1 is never a cached context.
        seen = torch.nn.functional.pad(visible[..., 1:length], (0, 1))
        ctx = ctx * seen
        cols = pos.clamp(0, length - 1)
        for t in range(n):  # slot t's input, where other slots see it
            sees = window_mask[:, :, t] & (pos[:, t, None] >= 0)
            at = cols[:, t, None].expand(b, n)
            cur = ctx.gather(2, at[..., None])[..., 0]
            ctx.scatter_(2, at[..., None], torch.where(sees, inputs[:, t, None], cur)[..., None])
        rows = self.model.prefix_index(ctx.reshape(b * n, length),
                                       (pos + 1).clamp(0, length - 1).reshape(b * n, 1))
        rows = rows.reshape(b, n)
        kept = store & (pos >= 0)
        self.seqs[images[:, None].expand(b, n)[kept], cols[kept]] = inputs[kept]
        pad = ~window_mask.diagonal(dim1=1, dim2=2)
        loose = ~store & ~pad
        rank = loose.long().cumsum(1) - 1
        self.scratch = torch.full((b, max(scratch, 1)), -1, dtype=torch.long, device=pos.device)
        if scratch:
            r = torch.arange(b, device=pos.device)[:, None].expand(b, n)
            self.scratch[r[loose], rank[loose].clamp(max=scratch - 1)] = inputs[loose]
        out = self.model.table[rows], self.model.uncond_table[rows] if self.cfg else None
        if self.record_features:
            self.features = out
        return out

    def keep_scratch(self, images, scratch, pos):  # noqa: ANN001, ANN201
        used = scratch >= 0
        r = torch.arange(len(images), device=pos.device)[:, None].expand_as(scratch)
        self.seqs[images[:, None].expand_as(scratch)[used], pos[used]] = \
            self.scratch[r[used], scratch[used]]
