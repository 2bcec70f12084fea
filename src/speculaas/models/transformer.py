"""A small decoder-only transformer with a static KV cache and per-row write positions.

Used twice: randomly initialised as the `tiny` test model, trained as the built-in model. The
cache is preallocated for every row and never copied on rollback: a row "rolls back" simply by
writing its next window at its committed length, and attention only sees keys at positions up
to the query's own (gpt-fast / nanochat style). That is what lets each image of a batch advance
by its own accepted length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_positive_ints


@dataclass(frozen=True)
class DecoderConfig:
    vocab_in: int  # input ids: condition tokens and image tokens share one table
    vocab_out: int  # output head: image tokens only
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 512
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_in", "vocab_out", "d_model", "n_layers", "n_heads",
                                   "max_len"))
        if self.d_model % (2 * self.n_heads):
            raise ValueError(f"d_model ({self.d_model}) must split into n_heads "
                             f"({self.n_heads}) heads of an even width (rotary halves)")
        if not (isinstance(self.rope_base, (int, float)) and self.rope_base > 1):
            raise ValueError(f"rope_base must be a number > 1, got {self.rope_base!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def rope_tables(max_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for every position, laid out for `_rope`: [max_len, head_dim] each, the
    cosines repeated over both halves and the sines negated on the first half."""
    half = head_dim // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = torch.arange(max_len, dtype=torch.float32)[:, None] * freqs
    cos, sin = ang.cos(), ang.sin()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding on half-split pairs: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    x [rows, L, heads, head_dim]; rope: the tables at the rows' positions, [rows, L, 1, head_dim].
    Four tensor ops for queries and keys together (bit for bit the textbook form)."""
    cos, sin = rope
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * sin


class KVCache:
    """Preallocated keys/values: [layers, rows, heads, max_len + spare, head_dim] each; the
    spare columns after max_len are a packed window's scratch (base.SCRATCH_SLOTS)."""

    def __init__(self, cfg: DecoderConfig, rows: int, device, dtype, spare: int = 0) -> None:  # noqa: ANN001
        hd = cfg.d_model // cfg.n_heads
        shape = (cfg.n_layers, rows, cfg.n_heads, cfg.max_len + spare, hd)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def _heads(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q, k, v [rows, L, heads, head_dim], rotary applied to q and k in one pass."""
        rows, length, _ = x.shape
        h = self.cfg.n_heads
        qkv = self.qkv(self.norm1(x)).view(rows, length, 3 * h, -1)
        q, k = _rope(qkv[:, :, : 2 * h], rope).split(h, dim=2)
        return q, k, qkv[:, :, 2 * h :]

    def forward(self, x, pos, rope, layer_cache=None, rows=None, mask=None, all_rows=False,  # noqa: ANN001, ANN201, E501
                write=None):
        """x [rows, L, d]; pos [rows, L]; rope: the rotary tables at pos (Decoder._rope_at).
        Without a cache: plain causal self-attention (training).

        With a cache (`layer_cache` = (k, v) of this layer, `rows` the cache rows these inputs
        belong to, `mask` [rows, 1, L, S]): the window's keys/values are written at their
        positions (or at `write` [rows, L] where given), then the queries attend to the first S
        cached positions of their rows. `all_rows`: rows is every cache row in order, so the
        cache is read as a view.
        """
        q, k, v = self._heads(x, rope)
        q = q.transpose(1, 2)  # [rows, heads, L, head_dim]
        if layer_cache is None:
            att = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
        else:
            ck, cv = layer_cache
            at = pos if write is None else write
            # Advanced indices around a slice move to the front: target view [rows, L, H, hd].
            ck[rows[:, None], :, at] = k
            cv[rows[:, None], :, at] = v
            span = mask.shape[-1]
            if all_rows:
                keys, values = ck[:, :, :span], cv[:, :, :span]
            else:
                keys, values = ck[rows, :, :span], cv[rows, :, :span]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(
                f"d_model {cfg.d_model} must split into an even head size over {cfg.n_heads} heads"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_in, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_out, bias=False)
        self.apply(self._init)
        cos, sin = rope_tables(cfg.max_len, cfg.d_model // cfg.n_heads, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[pos][:, :, None], self.rope_sin[pos][:, :, None]  # [rows, L, 1, hd]

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Training / reference path. ids [B, T] -> logits [B, T, vocab_out]."""
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        x, rope = self.embed(ids), self._rope_at(pos)
        for blk in self.blocks:
            x = blk(x, pos, rope)
        return self.head(self.norm(x))

    def _out(self, x: torch.Tensor, features: bool):  # noqa: ANN202
        """Final norm and output head: logits, or (logits, the normed states) with `features`
        (the output head's input: what a draft head reads)."""
        h = self.norm(x)
        return (self.head(h), h) if features else self.head(h)

    def new_cache(self, rows: int, spare: int = 0) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.cfg, rows, p.device, p.dtype, spare)

    def forward_cached(
        self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, rows: torch.Tensor,
        span: int | None = None, features: bool = False,
    ) -> torch.Tensor:
        """ids [R, L] placed at positions pos [R, L] of cache rows `rows` [R].

        Keys beyond a query's own position are masked, so whatever stale window a row left in
        its cache past its committed length is never seen. span: pos.max() + 1 if the caller
        knows it (else read from the device). Returns logits [R, L, vocab_out] (features: and
        the output head's input [R, L, d_model]).
        """
        span = int(pos.max()) + 1 if span is None else span
        if span > self.cfg.max_len:
            raise ValueError(
                f"sequence of {span} positions exceeds the model's max_len {self.cfg.max_len}"
            )
        keys = torch.arange(span, device=ids.device)
        x, rope = self.embed(ids), self._rope_at(pos)
        # [R, 1, L, S], once per call, additive: attention converts a boolean mask to this form
        # in every layer. Every query sees at least its own key, so no row is all -inf.
        visible = (keys[None, None, :] <= pos[:, :, None])[:, None]
        mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(
            ~visible, float("-inf"))
        all_rows = len(rows) == cache.k.shape[1]  # rows come sorted: every row, in order
        for i, blk in enumerate(self.blocks):
            x = blk(x, pos, rope, (cache.k[i], cache.v[i]), rows, mask, all_rows)
        return self._out(x, features)

    def forward_packed(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                       rows: torch.Tensor, mask: torch.Tensor, write: torch.Tensor,
                       features: bool = False) -> torch.Tensor:
        """A packed window (see Session.forward_packed): ids at positions pos [R, L], keys and
        values stored at cache columns `write` [R, L], then every query attends to the first S
        columns as mask [R, L, S] allows. Returns logits [R, L, vocab_out]."""
        if mask.shape[-1] > cache.k.shape[3]:
            raise ValueError(f"a packed window needs {mask.shape[-1]} cache positions; the "
                             f"cache has {cache.k.shape[3]}")
        x, rope = self.embed(ids), self._rope_at(pos)
        for i, blk in enumerate(self.blocks):
            x = blk(x, pos, rope, (cache.k[i], cache.v[i]), rows, mask[:, None], write=write)
        return self._out(x, features)
