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

import torch
import torch.nn.functional as F
from PIL import Image

from ..config import SamplingConfig
from .base import ImageModel, Layout, to_images
from .hf import PerImageCacheModel, checkpoint_or_model, processor_for

DEFAULTS = SamplingConfig(temperature=1.0, top_k=None, top_p=None, cfg_scale=5.0)


class JanusModel(PerImageCacheModel, ImageModel):
    name = "janus"

    def __init__(self, path: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None, model=None,  # noqa: ANN001
                 processor=None) -> None:  # noqa: ANN001
        from transformers import JanusForConditionalGeneration

        self.hf = checkpoint_or_model(JanusForConditionalGeneration, path, model, "janus", dtype)
        path = path or "the given model"
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
        self.text_config = cfg.text_config
        self.processor = processor_for(None if model is not None else path, processor)
        if self.processor is not None and self.boi_id is None:
            tok = self.processor.tokenizer
            self.boi_id = tok.convert_tokens_to_ids(self.processor.image_start_token)
        if self.boi_id is None:
            where = "the model object given" if model is not None else path
            raise ValueError(f"{where}: no image-start token id in generation_config."
                             "generation_kwargs['boi_token_id'] and no processor to read it "
                             "from; pass processor=JanusProcessor.from_pretrained(...) or set "
                             "model.generation_config.generation_kwargs = {'boi_token_id': ID}")

    def _ids(self, prompt) -> torch.Tensor:  # noqa: ANN001
        if isinstance(prompt, str):
            if self.processor is None:
                raise ValueError("no tokenizer to read a text prompt with (this Janus "
                                 "checkpoint ships none, or a model object came without "
                                 "processor=); pass processor=, or prompts as lists of token ids")
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

    def prefill(self, rows: torch.Tensor, cache) -> None:  # noqa: ANN001
        self.hf.model.language_model(inputs_embeds=self.hf.get_input_embeddings()(rows),
                                     past_key_values=cache, use_cache=True)

    def window_hidden(self, inputs: torch.Tensor, prompt_end: torch.Tensor | None, cache,
                      state=None) -> torch.Tensor:  # noqa: ANN001
        """Image tokens enter through the generation embedding + aligner; the prompt's last
        (image-start) token through the text embedding. -> the last hidden states."""
        emb = self.embed_image_tokens(inputs)
        if prompt_end is not None:
            text = self.hf.get_input_embeddings()(prompt_end[:, None]).to(emb.dtype)
            emb = torch.cat([text, emb[:, 1:]], 1)
        return self.hf.model.language_model(inputs_embeds=emb, past_key_values=cache,
                                            use_cache=True).last_hidden_state

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.prepare_embeddings_for_image_generation(tokens)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The generation head: hidden states -> image-token logits."""
        return self.hf.model.generation_head(hidden)

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        with torch.inference_mode():
            px = self.hf.decode_image_tokens(self.layout.image_tokens(tokens).to(self.device))
        return to_images(px.permute(0, 3, 1, 2))  # decode_image_tokens gives [B, H, W, C]

    def token_embeddings(self) -> torch.Tensor:
        return self.hf.model.generation_embeddings.weight.detach()

    def codebook(self) -> torch.Tensor:
        return F.normalize(self.hf.model.vqmodel.quantize.embedding.weight.detach().float(), dim=1)
