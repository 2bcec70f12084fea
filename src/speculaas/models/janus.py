"""Janus / Janus-Pro (1B, 7B) through transformers' `JanusForConditionalGeneration`.

Image tokens enter through the generation embedding and aligner, logits come from the
generation head (image vocabulary only), pixels from `decode_image_tokens`. CFG as Janus does
it: the unconditional rows are the prompt with every token but BOS and the image-start token
replaced by padding; default scale 5, no top-k. Text prompts go through the processor's chat
template and get the image-start tag appended, as the official generation script does; a list
of token ids is taken as an already templated prompt.

Each image keeps its own `DynamicCache` (conditional and unconditional rows together) and is
rolled back with `crop`, so every image advances by its own accepted length.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from ..config import SamplingConfig
from .base import ImageModel, Layout, Session

DEFAULTS = SamplingConfig(temperature=1.0, top_k=None, top_p=None, cfg_scale=5.0)


def rollback(cache, length: int) -> None:  # noqa: ANN001
    """Crop a transformers cache to `length` tokens (5.x `crop` takes minus the tokens to drop)."""
    drop = length - int(cache.get_seq_length())
    if drop < 0:
        cache.crop(drop)


def _check_family(path: str, model_type: str) -> None:
    local = Path(path)
    if local.exists():
        cfg = local / "config.json"
        if not cfg.is_file():
            raise ValueError(f"{cfg} not found: expected a {model_type} checkpoint folder "
                             "(config.json + model.safetensors)")
    from transformers import AutoConfig

    try:
        found = AutoConfig.from_pretrained(path).model_type
    except OSError as e:
        raise ValueError(f"cannot load a {model_type} config from {path!r}: {e}") from None
    if found != model_type:
        raise ValueError(f"{path!r} holds a {found!r} model, expected {model_type!r}")


class JanusModel(ImageModel):
    name = "janus"

    def __init__(self, path: str, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None) -> None:
        from transformers import JanusForConditionalGeneration

        _check_family(str(path), "janus")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        try:
            self.hf = JanusForConditionalGeneration.from_pretrained(path, dtype=dtype)
        except (OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot load Janus weights from {path!r}: {e}") from None
        self.device = torch.device(device)
        self.hf.to(self.device).eval()
        cfg = self.hf.config
        n = cfg.vision_config.num_image_tokens
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"{path}: num_image_tokens {n} is not a square grid")
        self.layout = Layout.raster(side, side)
        self.vocab_size = cfg.vq_config.num_embeddings
        self.defaults = DEFAULTS
        gen = self.hf.generation_config
        self.bos_id = gen.bos_token_id if gen.bos_token_id is not None else 1
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else 0
        kwargs = getattr(gen, "generation_kwargs", None) or {}
        self.boi_id = kwargs.get("boi_token_id")
        self.processor = None
        try:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(path)
            boi = self.processor.tokenizer.convert_tokens_to_ids(self.processor.image_start_token)
            self.boi_id = boi if self.boi_id is None else self.boi_id
        except (OSError, ValueError, AttributeError, TypeError):
            pass  # no tokenizer shipped: prompts must be token ids
        if self.boi_id is None:
            raise ValueError(f"{path}: no image-start token id in generation_config."
                             "generation_kwargs['boi_token_id'] and no processor to read it from")

    def _ids(self, prompt) -> torch.Tensor:  # noqa: ANN001
        if isinstance(prompt, str):
            if self.processor is None:
                raise ValueError("this Janus checkpoint ships no tokenizer; pass prompts as "
                                 "lists of token ids")
            messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
            ids = self.processor(text=text, generation_mode="image",
                                 return_tensors="pt").input_ids[0]
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = torch.tensor(list(prompt))
            if len(ids) == 0 or int(ids[-1]) != self.boi_id:
                ids = torch.cat([ids, torch.tensor([self.boi_id])])
        else:
            raise ValueError(f"Janus prompts are strings or lists of token ids, got {prompt!r}")
        return ids.to(self.device)

    def check_prompts(self, prompts: list) -> None:
        for p in prompts:
            self._ids(p)

    def unconditional(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids == self.bos_id) | (ids == self.boi_id)
        return torch.where(keep, ids, torch.full_like(ids, self.pad_id))

    def start(self, prompts: list, *, cfg: bool) -> Session:
        return _JanusSession(self, [self._ids(p) for p in prompts], cfg)

    def image_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.prepare_embeddings_for_image_generation(tokens)

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        with torch.inference_mode():
            px = self.hf.decode_image_tokens(self.layout.image_tokens(tokens).to(self.device))
        arr = ((px.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
        return [Image.fromarray(a) for a in arr]

    def token_embeddings(self) -> torch.Tensor:
        return self.hf.model.generation_embeddings.weight.detach()

    def codebook(self) -> torch.Tensor:
        return F.normalize(self.hf.model.vqmodel.quantize.embedding.weight.detach().float(), dim=1)


class _JanusSession(Session):
    def __init__(self, model: JanusModel, prompts: list[torch.Tensor], cfg: bool) -> None:
        from transformers import DynamicCache

        self.model = model
        self.batch_size = len(prompts)
        self.caches, self.prompt_len, self.last = [], [], []
        lm = model.hf.model.language_model
        embed = model.hf.get_input_embeddings()
        with torch.inference_mode():
            for ids in prompts:
                rows = torch.stack([ids, model.unconditional(ids)]) if cfg else ids[None]
                cache = DynamicCache(config=model.hf.config.text_config)
                if rows.shape[1] > 1:
                    lm(inputs_embeds=embed(rows[:, :-1]), past_key_values=cache, use_cache=True)
                self.caches.append(cache)
                self.prompt_len.append(rows.shape[1])
                self.last.append(embed(rows[:, -1:]))  # the image-start token, fed first

    @torch.inference_mode()
    def forward(self, inputs, offset, images):  # noqa: ANN001, ANN201
        hf, lm = self.model.hf, self.model.hf.model.language_model
        cond, uncond = [], []
        for row, (i, n) in enumerate(zip(images.tolist(), offset.tolist(), strict=True)):
            cache = self.caches[i]
            rollback(cache, self.prompt_len[i] - 1 + n)
            rows = self.last[i].shape[0]
            emb = self.model.image_embeddings(inputs[row].expand(rows, -1))
            if n == 0:
                emb = torch.cat([self.last[i].to(emb.dtype), emb[:, 1:]], 1)
            h = lm(inputs_embeds=emb, past_key_values=cache, use_cache=True).last_hidden_state
            logits = hf.model.generation_head(h).float()
            cond.append(logits[0])
            if rows == 2:
                uncond.append(logits[1])
        return torch.stack(cond), (torch.stack(uncond) if uncond else None)
