"""LlamaGen (class-conditional c2i and text-conditional t2i), implemented here so that its
released `.pt` checkpoints load with `weights_only=True`.

The GPT is Llama blocks (RMSNorm, SwiGLU, grouped-query attention) with LlamaGen's 2-D rotary
embedding: the condition prefix (1 class token, or 120 caption tokens) gets all-zero rotary
tables, image token i the (row, col) of its grid cell. Parameter names match the checkpoints
(`tok_embeddings`, `cls_embedding.*`, `layers.N.attention.wqkv`, ...). CFG by the null
condition: the extra class row of the label table (c2i) or the learned `uncond_embedding` (t2i).
The cache is our static per-row cache, so each image advances on its own.

The VQ-16 tokenizer is transformers' `JanusVQVAE` (the same design) with LlamaGen's weight
names mapped onto it (`conv_blocks.K.res.J` -> `up/down.K.block.J`, `mid.0/1/2` ->
`mid.block_1/attn_1/block_2`).

t2i prompts are precomputed caption embeddings: a [120, caption_dim] tensor (flan-t5-xl hidden
states, as LlamaGen makes them with its T5 embedder, left-padded), or a dict
{"embedding": tensor, "mask": [120] bool} whose False entries are padding.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ..config import SamplingConfig
from .base import (
    SCRATCH_SLOTS,
    DraftIO,
    ImageModel,
    Layout,
    Session,
    copy_scratch,
    packed_layout,
    resolve_dtype,
    to_images,
    weights_fingerprint,
)

# (dim, n_layer) -> n_head of LlamaGen's published GPT sizes.
N_HEADS = {
    (768, 12): 12,
    (1024, 24): 16,
    (1280, 36): 20,
    (1536, 48): 24,
    (2560, 48): 40,
    (2048, 22): 32,
    (3200, 24): 32,
    (4096, 32): 32,
}


# The reference sampling settings of LlamaGen's class- and text-conditional models.
C2I_DEFAULTS = SamplingConfig(temperature=1.0, top_k=2000, top_p=None, cfg_scale=4.0)
T2I_DEFAULTS = SamplingConfig(temperature=1.0, top_k=1000, top_p=None, cfg_scale=7.5)


def rotary_2d(grid: int, head_dim: int, base: float, prefix: int) -> torch.Tensor:
    """[prefix + grid**2, head_dim // 2, 2] (cos, sin): half the pairs rotate with the row,
    half with the column; the condition prefix gets zeros."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    t = torch.outer(torch.arange(grid).float(), freqs)
    ang = torch.cat([t[:, None, :].expand(-1, grid, -1), t[None, :, :].expand(grid, -1, -1)], -1)
    table = torch.stack([ang.cos(), ang.sin()], -1).flatten(0, 1)
    return torch.cat([torch.zeros(prefix, head_dim // 2, 2), table])


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [R, L, H, D] with interleaved pairs; rot [R, L, D/2, 2]."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = rot[:, :, None, :, 0], rot[:, :, None, :, 1]
    out = torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1)
    return out.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


class _Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


class _Block(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.attention = _Attention(dim, n_head, n_kv_head)
        self.feed_forward = _FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)


class _Labels(nn.Module):
    def __init__(self, num_classes: int, dim: int) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)  # last row: null class


class _MLP(nn.Module):
    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cin, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Captions(nn.Module):
    def __init__(self, caption_dim: int, dim: int, tokens: int) -> None:
        super().__init__()
        self.cap_proj = _MLP(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.zeros(tokens, caption_dim))


class LlamaGenGPT(nn.Module):
    def __init__(
        self,
        dim: int,
        n_layer: int,
        n_head: int,
        n_kv_head: int,
        vocab_size: int,
        ffn_hidden: int,
        grid: int,
        model_type: str = "c2i",
        num_classes: int = 1000,
        caption_dim: int = 2048,
        cls_token_num: int = 1,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.dim, self.n_layer, self.grid = dim, n_layer, grid
        self.model_type, self.cls_token_num = model_type, cls_token_num
        if model_type == "c2i":
            self.cls_embedding = _Labels(num_classes, dim)
        else:
            self.cls_embedding = _Captions(caption_dim, dim, cls_token_num)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            _Block(dim, n_head, n_kv_head, ffn_hidden, norm_eps) for _ in range(n_layer)
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.register_buffer(
            "rotary", rotary_2d(grid, dim // n_head, rope_base, cls_token_num), persistent=False
        )

    @property
    def max_len(self) -> int:
        return self.cls_token_num + self.grid**2

    def condition(self, prompts: list, null: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> prefix embeddings [B, C, dim] and which prefix positions are real [B, C]."""
        dev = self.tok_embeddings.weight.device
        if self.model_type == "c2i":
            null_id = self.cls_embedding.embedding_table.num_embeddings - 1
            ids = []
            for p in prompts:
                if p is not None and (
                    isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < null_id
                ):
                    raise ValueError(
                        f"LlamaGen c2i prompts are class ids in [0, {null_id}) or None, got {p!r}"
                    )
                ids.append(null_id if (p is None or null) else p)
            emb = self.cls_embedding.embedding_table(torch.tensor(ids, device=dev))[:, None]
            return emb, torch.ones(len(prompts), 1, dtype=torch.bool, device=dev)
        caps, masks = [], []
        uncond = self.cls_embedding.uncond_embedding
        for p in prompts:
            emb, mask = (p.get("embedding"), p.get("mask")) if isinstance(p, dict) else (p, None)
            if p is None:
                emb, mask = uncond, None
            elif null:
                # The null rows keep the caption's own padding mask, as LlamaGen's generate()
                # and its training (the caption drop swaps the embedding, not the mask) do.
                emb = uncond
            if not isinstance(emb, torch.Tensor) or tuple(emb.shape) != tuple(uncond.shape):
                raise ValueError(
                    f"LlamaGen t2i prompts are caption embeddings of shape "
                    f"{tuple(uncond.shape)} (or dicts with 'embedding' and 'mask')"
                )
            if mask is not None and (not isinstance(mask, torch.Tensor)
                                     or tuple(mask.shape) != (len(uncond),)):
                raise ValueError(f"a LlamaGen t2i caption mask is a bool tensor of shape "
                                 f"({len(uncond)},), got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            caps.append(emb.to(dev, uncond.dtype))
            masks.append(
                torch.ones(len(uncond), dtype=torch.bool, device=dev)
                if mask is None
                else mask.to(dev, torch.bool)
            )
        return self.cls_embedding.cap_proj(torch.stack(caps)), torch.stack(masks)

    def forward_cached(
        self, x: torch.Tensor, pos: torch.Tensor, cache: dict, rows: torch.Tensor,
        packed: tuple[torch.Tensor, torch.Tensor] | None = None, span: int | None = None,
        features: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [R, L, dim] embeddings at positions pos [R, L] of cache rows `rows` -> logits, or
        (logits, the final norm's output: what the output head reads) with `features`.

        packed = (mask [R, L, S], write [R, L]): store the keys at cache columns `write` and let
        each query see the first S columns as the mask says (Session.forward_packed)."""
        if packed is None:
            span = int(pos.max()) + 1 if span is None else span
            keys = torch.arange(span, device=x.device)
            visible = keys[None, None, :] <= pos[:, :, None]
            # Padded caption positions are hidden, except from themselves (no empty softmax rows).
            valid = cache["valid"][rows, :span]
            mask = (visible & (valid[:, None, :] | (keys[None, None, :] == pos[:, :, None])))
            write = pos
        else:
            mask, write = packed
            span = mask.shape[-1]
        mask = mask[:, None]
        rot = self.rotary[pos.clamp(max=self.rotary.shape[0] - 1)]
        for i, blk in enumerate(self.layers):
            att = blk.attention
            q, k, v = att.wqkv(blk.attention_norm(x)).split(
                [self.dim, att.n_kv_head * att.head_dim, att.n_kv_head * att.head_dim], -1
            )
            q = _rotate(q.view(*x.shape[:2], att.n_head, att.head_dim), rot)
            k = _rotate(k.view(*x.shape[:2], att.n_kv_head, att.head_dim), rot)
            v = v.view(*x.shape[:2], att.n_kv_head, att.head_dim)
            cache["k"][i][rows[:, None], :, write] = k
            cache["v"][i][rows[:, None], :, write] = v
            rep = att.n_head // att.n_kv_head
            ks = cache["k"][i][rows, :, :span].repeat_interleave(rep, 1)
            vs = cache["v"][i][rows, :, :span].repeat_interleave(rep, 1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), ks, vs, attn_mask=mask)
            x = x + att.wo(out.transpose(1, 2).reshape(x.shape))
            ff = blk.feed_forward
            h = blk.ffn_norm(x)
            x = x + ff.w2(F.silu(ff.w1(h)) * ff.w3(h))
        h = self.norm(x)
        return (self.output(h).float(), h) if features else self.output(h).float()

    def new_cache(self, rows: int) -> dict:
        att = self.layers[0].attention
        p = self.tok_embeddings.weight
        # Two spare columns after the image: raster windows park their overhang on the first;
        # packed windows put a stand-in anchor there and their padding on the second; then the
        # scratch of a candidate tree's branches (base.SCRATCH_SLOTS).
        shape = (self.n_layer, rows, att.n_kv_head, self.max_len + 2 + SCRATCH_SLOTS,
                 att.head_dim)
        return {
            "k": torch.zeros(shape, dtype=p.dtype, device=p.device),
            "v": torch.zeros(shape, dtype=p.dtype, device=p.device),
            "valid": torch.ones(rows, shape[3], dtype=torch.bool, device=p.device),
        }


def _state_dict(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"LlamaGen checkpoint not found: {path}")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle errors come in many types
        raise ValueError(f"cannot read {path} as a weights-only torch checkpoint: {e}") from None
    for key in ("model", "module", "state_dict", "ema"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict):
        raise ValueError(f"{path} holds a {type(sd).__name__}, not a state dict of named "
                         "tensors (expected a LlamaGen checkpoint)")
    return sd


def gpt_from_checkpoint(
    path: Path, image_size: int, n_head: int | None = None, downsample: int = 16
) -> LlamaGenGPT:
    sd = _state_dict(path)
    if "tok_embeddings.weight" not in sd:
        raise ValueError(f"{path}: not a LlamaGen GPT checkpoint (no tok_embeddings.weight)")
    vocab, dim = sd["tok_embeddings.weight"].shape
    n_layer = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k)))
    n_head = n_head or N_HEADS.get((dim, n_layer))
    if n_head is None:
        raise ValueError(f"{path}: unknown GPT size (dim {dim}, {n_layer} layers); pass n_head=")
    head_dim = dim // n_head
    qkv = sd["layers.0.attention.wqkv.weight"].shape[0]
    n_kv_head = (qkv - dim) // (2 * head_dim)
    grid = image_size // downsample
    kw = dict(
        dim=dim,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        vocab_size=vocab,
        ffn_hidden=sd["layers.0.feed_forward.w1.weight"].shape[0],
        grid=grid,
    )
    if "cls_embedding.embedding_table.weight" in sd:
        kw |= dict(
            model_type="c2i", num_classes=sd["cls_embedding.embedding_table.weight"].shape[0] - 1
        )
    else:
        unc = sd["cls_embedding.uncond_embedding"]
        kw |= dict(model_type="t2i", caption_dim=unc.shape[1], cls_token_num=unc.shape[0])
    model = LlamaGenGPT(**kw)
    _load_checked(model, sd, path)
    return model.eval()


def _load_checked(module: nn.Module, sd: dict, path: Path, required: tuple[str, ...] = ()) -> None:
    """Load `sd` into `module` after checking names and shapes. `required`: name prefixes that
    must all be present (default: every parameter of the module)."""
    wanted = {
        k: v for k, v in module.state_dict().items() if not required or k.startswith(required)
    }
    missing = sorted(set(wanted) - set(sd))
    if missing:
        raise ValueError(f"{path}: missing {len(missing)} tensors, e.g. {missing[0]}")
    for k, v in wanted.items():
        if sd[k].shape != v.shape:
            raise ValueError(
                f"{path}: {k} has shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}"
            )
    known = set(module.state_dict())
    module.load_state_dict({k: v for k, v in sd.items() if k in known}, strict=not required)


def llamagen_to_janus_names(sd: dict) -> dict:
    """LlamaGen VQModel weight names -> transformers JanusVQVAE names."""
    out = {}
    for k, v in sd.items():
        k2 = re.sub(r"^(encoder)\.conv_blocks\.(\d+)\.res\.", r"\1.down.\2.block.", k)
        k2 = re.sub(r"^(encoder)\.conv_blocks\.(\d+)\.", r"\1.down.\2.", k2)
        k2 = re.sub(r"^(decoder)\.conv_blocks\.(\d+)\.res\.", r"\1.up.\2.block.", k2)
        k2 = re.sub(r"^(decoder)\.conv_blocks\.(\d+)\.", r"\1.up.\2.", k2)
        k2 = re.sub(r"\.mid\.0\.", ".mid.block_1.", k2)
        k2 = re.sub(r"\.mid\.1\.", ".mid.attn_1.", k2)
        k2 = re.sub(r"\.mid\.2\.", ".mid.block_2.", k2)
        out[k2] = v
    return out


def vq16_from_checkpoint(path: Path, grid: int, **config):  # noqa: ANN003, ANN201
    """LlamaGen's VQ-16 weights in a JanusVQVAE (decoder, quantizer and post-quant conv are
    required; the encoder is loaded when present)."""
    from transformers.models.janus.configuration_janus import JanusVQVAEConfig
    from transformers.models.janus.modeling_janus import JanusVQVAE

    sd = llamagen_to_janus_names(_state_dict(path))
    if "quantize.embedding.weight" not in sd:
        raise ValueError(f"{path}: not a VQ checkpoint (no quantize.embedding.weight)")
    n_codes, embed_dim = sd["quantize.embedding.weight"].shape
    cfg = (
        dict(
            embed_dim=embed_dim,
            num_embeddings=n_codes,
            latent_channels=256,
            base_channels=128,
            channel_multiplier=[1, 1, 2, 2, 4],
            num_res_blocks=2,
            num_patches=grid,
            projection_dim=8,
            image_token_embed_dim=8,
        )
        | config
    )
    vq = JanusVQVAE(JanusVQVAEConfig(**cfg))
    _load_checked(vq, sd, path, required=("decoder.", "post_quant_conv.", "quantize."))
    return vq.eval()


def _load_t5(t5, tokenizer, device):  # noqa: ANN001, ANN202
    from transformers import AutoTokenizer, T5EncoderModel

    if isinstance(t5, (str, Path)):
        folder = Path(t5)
        if not (folder / "config.json").is_file():
            raise ValueError(f"{folder / 'config.json'} not found: t5= takes a local T5 encoder "
                             "folder (such as flan-t5-xl)")
        t5 = T5EncoderModel.from_pretrained(folder, trust_remote_code=False)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
            except (OSError, ValueError) as e:
                raise ValueError(f"no tokenizer in {folder}: pass t5_tokenizer= ({e})") from None
    if not isinstance(t5, T5EncoderModel):
        raise ValueError(f"t5= must be a folder or a T5EncoderModel, got {type(t5).__name__}")
    if tokenizer is None:
        raise ValueError("a T5EncoderModel given in memory needs its tokenizer: t5_tokenizer=")
    return t5.to(device).eval(), tokenizer


class LlamaGenModel(ImageModel):
    packed_forward = True
    name = "llamagen"

    def __init__(
        self,
        path: str,
        vq: str | None = None,
        image_size: int | None = None,
        n_head: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        vq_config: dict | None = None,
        t5=None,  # noqa: ANN001
        t5_tokenizer=None,  # noqa: ANN001
    ) -> None:
        """`t5`, `t5_tokenizer` (t2i only): a local T5 encoder folder (or a loaded transformers
        `T5EncoderModel`) and its tokenizer (read from the folder when not given), so text
        captions are encoded here as LlamaGen does; without them t2i prompts are embeddings."""
        path = Path(path)
        # LlamaGen's defaults: c2i at 256 px, t2i stage II at 512 px (16 px per token).
        size = image_size or (512 if "t2i" in path.name else 256)
        self.gpt = gpt_from_checkpoint(path, size, n_head)
        self.device = torch.device(device)
        self.gpt.to(self.device, dtype=resolve_dtype(dtype))
        grid = self.gpt.grid
        self.layout = Layout.raster(grid, grid)
        self.vocab_size = self.gpt.output.out_features
        c2i = self.gpt.model_type == "c2i"
        self.defaults = C2I_DEFAULTS if c2i else T2I_DEFAULTS
        self.vq = None
        if vq is not None:
            self.vq = vq16_from_checkpoint(Path(vq), grid, **(vq_config or {})).to(self.device)
        self.t5, self.t5_tokenizer = None, None
        if t5 is not None:
            if c2i:
                raise ValueError("t5= is for LlamaGen t2i checkpoints; this one is c2i")
            self.t5, self.t5_tokenizer = _load_t5(t5, t5_tokenizer, self.device)

    @torch.inference_mode()
    def encode_captions(self, captions: list[str]) -> list[dict]:
        """Text -> LlamaGen t2i conditions: T5 last hidden states of the caption padded to the
        model's caption length, then the valid tokens moved to the end (left padding) with the
        matching mask, as LlamaGen's sampling script arranges them."""
        if self.t5 is None:
            raise ValueError("LlamaGen t2i takes text only with a T5 encoder: load_model(..., "
                             "t5='path/to/flan-t5-xl'); otherwise pass caption embeddings")
        length = self.gpt.cls_embedding.uncond_embedding.shape[0]
        batch = self.t5_tokenizer(captions, max_length=length, padding="max_length",
                                  truncation=True, return_tensors="pt").to(self.device)
        hidden = self.t5(input_ids=batch.input_ids,
                         attention_mask=batch.attention_mask).last_hidden_state
        out = []
        for emb, mask in zip(hidden, batch.attention_mask.bool(), strict=True):
            n = int(mask.sum())
            left = torch.zeros_like(emb)
            left[length - n:] = emb[:n]
            valid = torch.zeros(length, dtype=torch.bool, device=emb.device)
            valid[length - n:] = True
            out.append({"embedding": left, "mask": valid})
        return out

    def _conditions(self, prompts: list) -> list:
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if not texts:
            return prompts
        encoded = self.encode_captions([prompts[i] for i in texts])
        prompts = list(prompts)
        for i, e in zip(texts, encoded, strict=True):
            prompts[i] = e
        return prompts

    def check_prompts(self, prompts: list) -> None:
        if any(isinstance(p, str) for p in prompts) and self.t5 is None:
            self.encode_captions([])  # raises the message saying how to pass text
        self.gpt.condition(self._conditions(prompts), null=False)

    def start(self, prompts: list, *, cfg: bool) -> Session:
        return _LlamaGenSession(self, self._conditions(prompts), cfg)

    def admit(self, session: Session, rows: list[int], prompts: list) -> None:
        session.admit(rows, self._conditions(prompts))

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        if self.vq is None:
            raise ValueError(
                "no VQ tokenizer loaded: pass vq='vq_ds16_c2i.pt' (or t2i) to "
                "load_model('llamagen', ...)"
            )
        with torch.inference_mode():
            px = self.vq.decode(tokens.to(self.device))
        return to_images(px)

    def token_embeddings(self) -> torch.Tensor:
        return self.gpt.tok_embeddings.weight.detach()

    def draft_io(self) -> DraftIO:
        gpt = self.gpt
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = weights_fingerprint(self.name, gpt)
        return DraftIO(dim=gpt.dim, embed=gpt.tok_embeddings,
                       logits=lambda h: gpt.output(h).float(), fingerprint=self._fingerprint,
                       dtype=gpt.output.weight.dtype)

    def codebook(self) -> torch.Tensor | None:
        if self.vq is None:
            return None
        return F.normalize(self.vq.quantize.embedding.weight.detach().float(), dim=1)


class _LlamaGenSession(Session):
    def __init__(self, model: LlamaGenModel, prompts: list, cfg: bool) -> None:
        gpt = model.gpt
        self.gpt, self.batch_size, self.cfg = gpt, len(prompts), cfg
        emb, valid = gpt.condition(prompts, null=False)
        if cfg:
            null_emb, null_valid = gpt.condition(prompts, null=True)
            emb, valid = torch.cat([emb, null_emb]), torch.cat([valid, null_valid])
        rows = len(emb)
        self.cache = gpt.new_cache(rows)
        self.cache["valid"][:, : valid.shape[1]] = valid
        self.prefix = gpt.cls_token_num
        self.last = emb[:, -1:]  # the last condition token opens the first window
        if self.prefix > 1:
            pos = torch.arange(self.prefix - 1, device=emb.device).expand(rows, -1)
            with torch.inference_mode():
                gpt.forward_cached(
                    emb[:, :-1], pos, self.cache, torch.arange(rows, device=emb.device)
                )

    def context_length(self) -> int:
        return self.prefix

    @torch.inference_mode()
    def admit(self, rows: list[int], prompts: list) -> None:
        """Continuous batching: images `rows` start over with new conditions (their condition
        columns and, with CFG, their unconditional rows rewritten; generated columns are
        overwritten as the new images advance)."""
        gpt = self.gpt
        idx = torch.tensor(rows, device=self.last.device)
        emb, valid = gpt.condition(prompts, null=False)
        if self.cfg:
            null_emb, null_valid = gpt.condition(prompts, null=True)
            idx = torch.cat([idx, idx + self.batch_size])
            emb, valid = torch.cat([emb, null_emb]), torch.cat([valid, null_valid])
        self.cache["valid"][idx, : valid.shape[1]] = valid
        self.last[idx] = emb[:, -1:].to(self.last.dtype)
        if self.prefix > 1:
            pos = torch.arange(self.prefix - 1, device=emb.device).expand(len(idx), -1)
            gpt.forward_cached(emb[:, :-1], pos, self.cache, idx)

    @torch.inference_mode()
    def forward(self, inputs, offset, images, max_offset=None):  # noqa: ANN001, ANN201
        rows = torch.cat([images, images + self.batch_size]) if self.cfg else images
        if self.cfg:
            inputs, offset = torch.cat([inputs, inputs]), torch.cat([offset, offset])
        x = self.gpt.tok_embeddings(inputs)
        first = (offset == 0)[:, None, None]
        x = torch.cat([torch.where(first, self.last[rows].to(x.dtype), x[:, :1]), x[:, 1:]], 1)
        pos = self.prefix - 1 + offset[:, None] + torch.arange(inputs.shape[1], device=x.device)
        pos = pos.clamp(max=self.gpt.max_len)  # slots past the image: a spare cache slot
        span = (None if max_offset is None
                else min(self.prefix - 2 + max_offset + inputs.shape[1], self.gpt.max_len) + 1)
        out = self.gpt.forward_cached(x, pos, self.cache, rows, span=span,
                                      features=self.record_features)
        return self._split(out)

    @torch.inference_mode()
    def forward_packed(self, inputs, pos, images, visible, window_mask, store, scratch=0):  # noqa: ANN001, ANN201, E501
        rows = torch.cat([images, images + self.batch_size]) if self.cfg else images
        prompt = self.cache["valid"][images, : self.prefix - 1]
        mask, write = packed_layout(self.prefix, prompt, pos, visible, window_mask, store,
                                    scratch)
        self.scratch_at = self.prefix + visible.shape[-1] + 2
        x = self.gpt.tok_embeddings(inputs)
        x = torch.where((pos == -1)[..., None], self.last[images].to(x.dtype), x)
        cache_pos = self.prefix + pos  # generated position -1 is the last condition token
        if self.cfg:
            null = torch.where((pos == -1)[..., None],
                               self.last[images + self.batch_size].to(x.dtype), x)
            x = torch.cat([x, null])
            prompt = self.cache["valid"][images + self.batch_size, : self.prefix - 1]
            null_mask, _ = packed_layout(self.prefix, prompt, pos, visible, window_mask, store,
                                         scratch)
            mask, cache_pos, write = torch.cat([mask, null_mask]), *(
                torch.cat([t, t]) for t in (cache_pos, write))
        out = self.gpt.forward_cached(x, cache_pos, self.cache, rows, (mask, write),
                                      features=self.record_features)
        return self._split(out)

    @torch.inference_mode()
    def keep_scratch(self, images, scratch, pos):  # noqa: ANN001, ANN201
        copy_scratch((self.cache["k"], self.cache["v"]), self.batch_size if self.cfg else 0,
                     images, scratch, pos, self.scratch_at, self.prefix)


def make_checkpoint(model: LlamaGenGPT, path: Path) -> None:
    """Save in LlamaGen's released layout ({'model': state_dict}); used by tests and tools."""
    torch.save({"model": {k: v for k, v in model.state_dict().items()}}, path)


__all__ = [
    "LlamaGenGPT",
    "LlamaGenModel",
    "gpt_from_checkpoint",
    "make_checkpoint",
    "llamagen_to_janus_names",
    "rotary_2d",
]
