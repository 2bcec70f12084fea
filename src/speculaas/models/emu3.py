"""Emu3 through transformers' `Emu3ForConditionalGeneration`.

The adapter forces Emu3's layout: every row of `width` visual tokens is followed by the
end-of-line token `<|extra_200|>`, which is committed without being speculated. The rules see
a distribution over the visual codes plus one extra index for end-of-line. CFG is batched by the
adapter (conditional and unconditional rows in one cache; transformers' own Emu3 CFG runs a
second model call one token at a time and cannot verify a window). The unconditional row is the
prompt with its text replaced by padding, so both rows have the same length. Pixels come from
`Emu3VQVAE.decode`.

Prompts are lists of token ids in Emu3's generation format (bos, text, image start,
"{H}*{W}", image token) or, when the checkpoint ships a processor, strings, to which Emu3's
quality suffix is appended as its own script does (`quality_suffix=""` turns it off).
"""

from __future__ import annotations

import torch
from PIL import Image

from ..config import SamplingConfig
from .base import ImageModel, Layout, Session, to_images
from .hf import PerImageCacheSession, checkpoint_or_model, processor_for

DEFAULTS = SamplingConfig(temperature=1.0, top_k=2048, top_p=None, cfg_scale=3.0)
# Emu3's generation script appends this to every caption (its "positive prompt").
QUALITY_SUFFIX = " masterpiece, film grained, best quality."


class Emu3Model(ImageModel):
    name = "emu3"

    def __init__(
        self,
        path: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        grid: tuple[int, int] = (90, 90),
        model=None,  # noqa: ANN001
        processor=None,  # noqa: ANN001
        quality_suffix: str | None = QUALITY_SUFFIX,
    ) -> None:
        """quality_suffix: appended to text prompts, as Emu3's own script does ("" or None:
        the caption as written)."""
        from transformers import Emu3ForConditionalGeneration

        if quality_suffix is not None and not isinstance(quality_suffix, str):
            raise ValueError(f"quality_suffix must be a string, got {quality_suffix!r}")
        self.quality_suffix = quality_suffix or ""
        self.hf = checkpoint_or_model(Emu3ForConditionalGeneration, path, model, "emu3", dtype)
        given = model is not None
        path = path or "the given model"
        self.device = torch.device(device)
        self.hf.to(self.device).eval()
        vm = self.hf.model.vocabulary_mapping
        code2bpe = vm.img2bpe_mapping_tensor.long()
        self.codes = len(code2bpe)
        self.eol_id = vm.eol_token_id
        # Distribution index -> BPE id: the visual codes, then end-of-line at index `codes`.
        self.index_to_bpe = torch.cat([code2bpe, torch.tensor([self.eol_id])]).to(self.device)
        self.vocab_size = self.codes + 1
        rows, cols = grid
        self.layout = Layout.with_row_end(rows, cols, self.codes)
        self.defaults = DEFAULTS
        vocab = vm.vocab_map
        self.bos_id = self.hf.config.text_config.bos_token_id
        self.pad_id = self.hf.config.text_config.pad_token_id
        self.boi_id = vocab.get("<|image start|>")
        if self.boi_id is None:
            raise ValueError(f"{path}: vocabulary has no '<|image start|>' token")
        self.text_config = self.hf.config.text_config
        self.processor = processor_for(None if given else path, processor)

    def _ids(self, prompt) -> torch.Tensor:  # noqa: ANN001
        if isinstance(prompt, str):
            if self.processor is None:
                raise ValueError(
                    "this Emu3 checkpoint ships no processor; pass prompts as lists of token ids"
                )
            rows, cols = self.grid
            ids = self.processor(  # the size header states this grid: "{rows}*{cols}"
                text=[prompt + self.quality_suffix],
                return_for_image_generation=True,
                ratio=f"{cols}:{rows}",  # width:height; with the area, exactly rows x cols
                image_area=rows * cols * 64,
                return_tensors="pt",
            ).input_ids[0]
        elif (
            isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            ids = torch.tensor(list(prompt))
        else:
            raise ValueError(f"Emu3 prompts are strings or lists of token ids, got {prompt!r}")
        if not (ids == self.boi_id).any():
            raise ValueError(
                "an Emu3 prompt must contain the image-start token "
                f"(id {self.boi_id}) followed by the size and image tokens"
            )
        return ids.to(self.device)

    def check_prompts(self, prompts: list) -> None:
        for p in prompts:
            self._ids(p)

    def unconditional(self, ids: torch.Tensor) -> torch.Tensor:
        """Text between the first token and the image-start token replaced by padding."""
        boi = int((ids == self.boi_id).nonzero()[0, 0])
        out = ids.clone()
        out[1:boi] = self.pad_id
        return out

    def start(self, prompts: list, *, cfg: bool) -> Session:
        return PerImageCacheSession(self, [self._ids(p) for p in prompts], cfg)

    def prefill(self, rows: torch.Tensor, cache) -> None:  # noqa: ANN001
        self.hf.model(input_ids=rows, past_key_values=cache, use_cache=True)

    def window_logits(
        self, inputs: torch.Tensor, prompt_end: torch.Tensor | None, cache, state=None
    ) -> torch.Tensor:  # noqa: ANN001
        ids = self.index_to_bpe[inputs].clone()
        if prompt_end is not None:
            ids[:, 0] = prompt_end
        h = self.hf.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
        return self.hf.lm_head(h)[..., self.index_to_bpe]

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        rows, cols = self.grid
        codes = self.layout.image_tokens(tokens).to(self.device).view(-1, rows, cols)
        with torch.inference_mode():
            px = self.hf.model.vqmodel.decode(codes)
        return to_images(px)

    def token_embeddings(self) -> torch.Tensor:
        return self.hf.get_input_embeddings().weight[self.index_to_bpe].detach()
