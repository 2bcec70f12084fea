"""The model-adapter protocol: everything the decoding loop needs to know about a model.

The loop speaks of a *generated sequence* of `layout.length` positions (image tokens plus any
structural tokens the model forces, such as an end-of-row token). A `Session` holds the KV cache
of one batch of prompts; `Session.forward` feeds a window of generated tokens and returns the
logits for the positions that follow each of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..config import MAX_TREE_NODES, SamplingConfig


@dataclass(frozen=True)
class Layout:
    """Generated-sequence layout.

    length: T generated positions. grid: (rows, cols) of image cells.
    forced: [T] long, the token forced at each position, -1 where the model chooses.
    cells: [T] long, raster index of the grid cell each position fills, -1 for structural tokens.
    structural: ids of structural tokens, which free positions must never sample.
    """

    length: int
    grid: tuple[int, int]
    forced: torch.Tensor
    cells: torch.Tensor
    structural: tuple[int, ...] = ()

    @classmethod
    def raster(cls, rows: int, cols: int) -> Layout:
        n = rows * cols
        return cls(n, (rows, cols), torch.full((n,), -1, dtype=torch.long), torch.arange(n))

    @classmethod
    def with_row_end(cls, rows: int, cols: int, row_end_token: int) -> Layout:
        """Every row of `cols` image tokens is followed by a forced end-of-row token."""
        n = rows * (cols + 1)
        col = torch.arange(n) % (cols + 1)
        is_end = col == cols
        forced = torch.where(is_end, row_end_token, -1)
        cells = torch.full((n,), -1, dtype=torch.long)
        cells[~is_end] = torch.arange(rows * cols)
        return cls(n, (rows, cols), forced, cells, (row_end_token,))

    def image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] generated tokens -> [B, rows * cols] image tokens in raster order."""
        return tokens[:, self.cells >= 0]

    def sequence(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """Inverse of `image_tokens`: [B, rows * cols] -> [B, T] with the forced tokens."""
        forced = self.forced.to(image_tokens.device)
        seq = forced.expand(len(image_tokens), -1).clone()
        seq[:, self.cells.to(image_tokens.device) >= 0] = image_tokens
        return seq


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """"bfloat16" or torch.bfloat16 -> torch.bfloat16 (None stays None: the weights' own);
    anything that is not a floating dtype -> ValueError."""
    if dtype is None:
        return None
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return value


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """Decoder output [B, 3, H, W] in about [-1, 1] -> uint8 [B, H, W, 3]."""
    x = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def to_images(pixels: torch.Tensor) -> list[Image.Image]:
    """Decoder output [B, 3, H, W] in about [-1, 1] -> one PIL image per row."""
    return [Image.fromarray(a) for a in to_uint8(pixels)]


class Session(ABC):
    """The cache of one batch of prompts (conditional rows, plus unconditional rows for CFG).

    Sessions of models with a `draft_io` record, when `record_features` is set, the output
    head's input of every slot of each forward in `features`: (cond [b, L, d], uncond or None),
    what a trained draft head reads (decoding/drafting.py)."""

    batch_size: int
    record_features: bool = False
    features: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _split(self, out):  # noqa: ANN001, ANN202
        """A forward's output over [cond rows; uncond rows] (logits, or (logits, features)
        where recorded) -> (cond, uncond or None) logits, the features kept in `features`."""
        if self.record_features:
            out, feats = out
            self.features = tuple(feats.chunk(2)) if self.cfg else (feats, None)
        if self.cfg:
            cond, uncond = out.chunk(2)
            return cond, uncond
        return out, None

    def context_length(self) -> int:
        """Tokens before the first image token (the longest prompt of the batch): part of what
        an iteration costs."""
        return 0

    @abstractmethod
    def forward(self, inputs: torch.Tensor, offset: torch.Tensor, images: torch.Tensor,
                max_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed a window and return (cond_logits, uncond_logits or None), each [b, L, vocab].

        images [b]: which images of the batch these rows are. offset [b]: how many generated
        tokens each of them has committed (n). inputs [b, L]: inputs[:, j] is the generated
        token at position n - 1 + j; when n == 0 the first entry is a placeholder and the
        adapter feeds the end of the prompt there. Output slot j is the distribution of
        generated position n + j. Cache entries a row wrote past its committed prefix in an
        earlier call must not influence the result (rollback by position). max_offset: the
        caller's host copy of offset.max(), if it has one, so the adapter need not read the
        device to size its attention (every read stalls a GPU).
        """

    def forward_packed(self, inputs: torch.Tensor, pos: torch.Tensor, images: torch.Tensor,
                       visible: torch.Tensor, window_mask: torch.Tensor, store: torch.Tensor,
                       scratch: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed several segments per image in one forward (the two-dimensional window).

        inputs, pos, store [b, S]: slot s feeds token inputs[:, s] at generated position
        pos[:, s] (-1: the end of the prompt, the token is then ignored) and its output is the
        distribution of generated position pos + 1. visible [b, S, T]: which generated
        positions -1 .. T-2 of the cache each slot attends to (nothing follows T-1);
        window_mask [b, S, S]: which slots of this window it attends to. Slots with `store`
        keep their keys in the cache at their position; the others leave no trace. scratch: 0
        when at most one slot per image is neither stored nor padding (a stand-in anchor); n > 0
        when up to n are (the branches of a candidate tree): the i-th unstored slot of a row
        keeps its keys in scratch column i until the next call, for `keep_scratch`. Adapters
        whose models cannot take such a mask leave this unimplemented
        (ImageModel.packed_forward is False).
        """
        raise NotImplementedError(f"{type(self).__name__} has no packed forward")

    def keep_scratch(self, images: torch.Tensor, scratch: torch.Tensor,
                     pos: torch.Tensor) -> None:
        """After a packed forward with scratch columns: copy the keys of scratch column
        scratch[:, j] of images [b] into the cache at generated position pos[:, j] (a branch of
        the tree was committed there); -1 entries copy nothing."""
        raise NotImplementedError(f"{type(self).__name__} has no packed forward")


@dataclass(frozen=True)
class DraftIO:
    """What a trained draft head needs of its target: the feature width `dim` (the output
    head's input), `embed(tokens [...]) -> [..., dim]` (the input embedding of generated
    tokens, as the model feeds them), `logits(features [..., dim]) -> [..., vocab]` (the output
    head, as the model's own logits come from it) and `fingerprint`: a digest of the target's
    weights that names it (a head trained on another target is refused)."""

    dim: int
    embed: object
    logits: object
    fingerprint: str
    dtype: torch.dtype = torch.float32  # what `logits` takes


def weights_fingerprint(name: str, module: torch.nn.Module) -> str:
    """sha256 (first 16 hex digits) of a module's parameters, names and shapes with the model's
    name: what ties a draft head to one set of weights."""
    import hashlib

    h = hashlib.sha256(name.encode())
    for key, value in module.state_dict().items():
        h.update(f"{key}{tuple(value.shape)}{value.dtype}".encode())
        h.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class ImageModel(ABC):
    name: str
    vocab_size: int  # size of the distributions the rules see
    layout: Layout
    defaults: SamplingConfig
    device: torch.device = torch.device("cpu")
    # Whether sessions implement `forward_packed` and `keep_scratch` (needed by row_context, the
    # 2-D window, and by candidate trees).
    packed_forward: bool = False

    @property
    def grid(self) -> tuple[int, int]:
        return self.layout.grid

    @abstractmethod
    def start(self, prompts: list, *, cfg: bool) -> Session:
        """Prefill the prompts; with `cfg`, also the unconditional rows."""

    @abstractmethod
    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        """[B, T] generated tokens -> one PIL image per row."""

    def admit(self, session: Session, rows: list[int], prompts: list) -> None:
        """Continuous batching: put `prompts` into rows `rows` of a running session (prefill
        them; the rows' earlier contents are forgotten). Adapters that cannot say so."""
        raise ValueError(f"model {self.name!r} cannot admit requests into a running batch")

    def check_prompts(self, prompts: list) -> None:  # noqa: B027 - optional hook
        """Raise ValueError if a prompt is not one this model can take (default: accept)."""

    def token_embeddings(self) -> torch.Tensor | None:
        """[vocab, dim] input embeddings of the tokens (GSD's static clusters), if any."""
        return None

    def codebook(self) -> torch.Tensor | None:
        """[vocab, dim] VQ codes as decoding uses them (LANTERN's neighbours), if any."""
        return None

    def draft_io(self) -> DraftIO | None:
        """The target's side of a trained draft head (DraftIO), or None where the adapter's
        sessions do not record features."""
        return None


class PrefixDecoderSession(Session):
    """Session over our own `Decoder`: a fixed-length prompt prefix, then generated tokens.

    Rows 0..B-1 are conditional, rows B..2B-1 (with CFG) unconditional: the same generated
    tokens are fed to both halves, so one cache holds both and rolls back by position.
    """

    def __init__(self, decoder, prefix: torch.Tensor, null_prefix: torch.Tensor | None,
                 token_offset: int) -> None:
        self.decoder = decoder
        self.batch_size = prefix.shape[0]
        self.cfg = null_prefix is not None
        ids = prefix if null_prefix is None else torch.cat([prefix, null_prefix])
        self.prompt_len = ids.shape[1]
        self.token_offset = token_offset
        self.cache = decoder.new_cache(ids.shape[0], SCRATCH_SLOTS)
        self.last_prompt = ids[:, -1]
        device = ids.device
        self.all_rows = torch.arange(ids.shape[0], device=device)
        if self.prompt_len > 1:
            pos = torch.arange(self.prompt_len - 1, device=device).expand(ids.shape[0], -1)
            with torch.inference_mode():
                decoder.forward_cached(ids[:, :-1], pos, self.cache, self.all_rows)

    def context_length(self) -> int:
        return self.prompt_len

    @torch.inference_mode()
    def admit(self, rows: list[int], prefix: torch.Tensor, null_prefix: torch.Tensor | None,
              ) -> None:
        """Prefill rows `rows` with new prompts prefix [r, P] (null_prefix [r, P]: their
        unconditional rows, with CFG): continuous batching (ImageModel.admit)."""
        idx = torch.tensor(rows, device=prefix.device)
        ids = prefix
        if self.cfg:
            idx, ids = torch.cat([idx, idx + self.batch_size]), torch.cat([prefix, null_prefix])
        self.last_prompt[idx] = ids[:, -1]
        if self.prompt_len > 1:
            pos = torch.arange(self.prompt_len - 1, device=ids.device).expand(ids.shape[0], -1)
            self.decoder.forward_cached(ids[:, :-1], pos, self.cache, idx)

    @torch.inference_mode()
    def forward(self, inputs, offset, images, max_offset=None):  # noqa: ANN001, ANN201
        rows = torch.cat([images, images + self.batch_size]) if self.cfg else images
        ids = inputs + self.token_offset
        if self.cfg:  # each half's anchor at offset 0 is its own prompt's last token
            ids, offset = torch.cat([ids, ids]), torch.cat([offset, offset])
        ids[:, 0] = torch.where(offset == 0, self.last_prompt[rows], ids[:, 0])
        pos = self.prompt_len - 1 + offset[:, None] + torch.arange(ids.shape[1], device=ids.device)
        # Slots past a row's last position carry no information; park them on the last cache
        # slot, which no valid query ever reads.
        last = self.decoder.cfg.max_len - 1
        pos = pos.clamp(max=last)
        span = (None if max_offset is None
                else min(self.prompt_len - 2 + max_offset + ids.shape[1], last) + 1)
        logits = self.decoder.forward_cached(ids, pos, self.cache, rows, span,
                                             features=self.record_features)
        return self._split(logits)

    @torch.inference_mode()
    def forward_packed(self, inputs, pos, images, visible, window_mask, store, scratch=0):  # noqa: ANN001, ANN201, E501
        rows = torch.cat([images, images + self.batch_size]) if self.cfg else images
        prompt = visible.new_ones(len(images), self.prompt_len - 1)
        mask, write = packed_layout(self.prompt_len, prompt, pos, visible, window_mask, store,
                                    scratch)
        self.scratch_at = self.prompt_len + visible.shape[-1] + 2
        ids = inputs + self.token_offset
        ids = torch.where(pos == -1, self.last_prompt[images][:, None], ids)
        cache_pos = self.prompt_len + pos  # generated position -1 is the last prompt token
        if self.cfg:
            null = torch.where(pos == -1, self.last_prompt[images + self.batch_size][:, None],
                               ids)
            ids = torch.cat([ids, null])
            mask, cache_pos, write = (torch.cat([t, t]) for t in (mask, cache_pos, write))
        logits = self.decoder.forward_packed(ids, cache_pos, self.cache, rows, mask, write,
                                             features=self.record_features)
        return self._split(logits)

    @torch.inference_mode()
    def keep_scratch(self, images, scratch, pos):  # noqa: ANN001, ANN201
        copy_scratch((self.cache.k, self.cache.v), self.batch_size if self.cfg else 0, images,
                     scratch, pos, self.scratch_at, self.prompt_len)


def decoder_draft_io(decoder, token_offset: int, fingerprint: str) -> DraftIO:  # noqa: ANN001
    """DraftIO of a model over our own `Decoder` (PrefixDecoderSession's layout of ids)."""
    return DraftIO(dim=decoder.cfg.d_model,
                   embed=lambda tokens: decoder.embed(tokens + token_offset),
                   logits=decoder.head, fingerprint=fingerprint,
                   dtype=decoder.head.weight.dtype)


# Scratch columns a cache keeps after its two spare ones: the most unstored slots (branches of a
# candidate tree) one packed forward may hold per image.
SCRATCH_SLOTS = MAX_TREE_NODES


def copy_scratch(caches: tuple[torch.Tensor, ...], uncond_offset: int, images: torch.Tensor,
                 scratch: torch.Tensor, pos: torch.Tensor, scratch_at: int, base: int) -> None:
    """Session.keep_scratch for caches laid out [layers, rows, heads, columns, head_dim], whose
    scratch column i sits at scratch_at + i and generated position g at base + g (rows
    images + uncond_offset too, when uncond_offset > 0: the unconditional half)."""
    rows = images if not uncond_offset else torch.cat([images, images + uncond_offset])
    if uncond_offset:
        scratch, pos = torch.cat([scratch, scratch]), torch.cat([pos, pos])
    used = scratch >= 0
    src = torch.where(used, scratch_at + scratch, scratch_at - 1)  # unused: dump onto dump
    dst = torch.where(used, base + pos, scratch_at - 1)
    r = rows[:, None].expand_as(src)
    for c in caches:
        c[:, r, :, dst] = c[:, r, :, src]


def packed_layout(base: int, prompt_visible: torch.Tensor, pos: torch.Tensor,
                  visible: torch.Tensor, window_mask: torch.Tensor,
                  store: torch.Tensor, scratch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache columns and attention mask of a packed window (Session.forward_packed).

    A session whose generated position g sits at cache column base + g (so the prompt fills
    columns 0 .. base - 2 and its last token base - 1) needs two spare columns after the
    image: base + T takes the key of a slot that must leave no trace (a stand-in anchor; at
    most one per image and call), base + T + 1 the padding (slots that do not see themselves).
    Keys are written before attention, in position order, so a window of one segment computes
    exactly what the raster forward computes. With scratch = n > 0, the i-th unstored slot of a
    row (padding not counted) writes to column base + T + 2 + i instead, so that
    many slots can leave no trace and still be seen by others (SCRATCH_SLOTS columns at most).
    prompt_visible [b, base - 1]; the rest as in forward_packed. Returns mask
    [b, S, base + T + 2 + scratch] and write columns [b, S].
    """
    b, n_slots, length = visible.shape
    stand_in, dump = base + length, base + length + 1
    if scratch > SCRATCH_SLOTS:
        raise ValueError(f"a packed window may keep {SCRATCH_SLOTS} unstored slots per image, "
                         f"not {scratch}")
    pad = ~window_mask.diagonal(dim1=1, dim2=2)
    if scratch:
        rank = (~store & ~pad).long().cumsum(1) - 1
        stand_in = dump + 1 + rank.clamp(0, scratch - 1)
    write = torch.where(store, base + pos, torch.where(pad, dump, stand_in))
    mask = visible.new_zeros(b, n_slots, base + length + 2 + scratch)
    mask[..., : base - 1] = prompt_visible[:, None]
    mask[..., base - 1 : base - 1 + length] = visible
    own = torch.zeros_like(mask).scatter_(2, write[:, None, :].expand(-1, n_slots, -1),
                                          window_mask)
    mask |= own
    mask[..., dump] |= pad  # padding sees only itself (never an empty softmax row)
    return mask, write
