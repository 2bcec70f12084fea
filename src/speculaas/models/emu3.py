"""Emu3 through transformers' `Emu3ForConditionalGeneration`.

The adapter forces Emu3's layout: every row of `width` visual tokens is followed by the
end-of-line token `<|extra_200|>`, which is committed without being speculated. The rules see
a distribution over the visual codes plus one extra index for end-of-line. CFG is batched by the
adapter (conditional and unconditional rows in one cache; transformers' own Emu3 CFG runs a
second model call one token at a time and cannot verify a window). The unconditional row is
Emu3's negative prompt, as its own script guides, in the same generation format and fully
attended; the shorter of the two rows is left-padded and the padding hidden by the attention
mask, so each row is scored as if alone. Pixels come from `Emu3VQVAE.decode`.

Prompts are lists of token ids in Emu3's generation format (bos, text, image start,
"{H}*{W}", image token) or, when the checkpoint ships a processor, strings, to which Emu3's
quality suffix is appended as its own script does (`quality_suffix=""` turns it off).
"""

from __future__ import annotations

import torch
from PIL import Image

from ..config import SamplingConfig
from .base import ImageModel, Layout, to_images
from .hf import SharedVocabularyModel, checkpoint_or_model, processor_for

DEFAULTS = SamplingConfig(temperature=1.0, top_k=2048, top_p=None, cfg_scale=3.0)
# Emu3's generation script appends this to every caption (its "positive prompt").
QUALITY_SUFFIX = " masterpiece, film grained, best quality."
# ... and guides with this negative prompt as the unconditional row.
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, "
                   "fewer digits, cropped, worst quality, low quality, normal quality, jpeg "
                   "artifacts, signature, watermark, username, blurry.")


class Emu3Model(SharedVocabularyModel, ImageModel):
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
        negative_prompt: str | list[int] | None = NEGATIVE_PROMPT,
    ) -> None:
        """quality_suffix: appended to text prompts, as Emu3's own script does ("" or None:
        the caption as written). negative_prompt: the unconditional row's text (Emu3's own by
        default; "" for none), tokenized like a caption without the suffix, or token ids in the
        generation format; None: the caption with its text replaced by padding (attended).
        A checkpoint without a processor cannot tokenize a text negative prompt: it guides as
        with None unless the negative prompt is given as ids."""
        from transformers import Emu3ForConditionalGeneration

        if quality_suffix is not None and not isinstance(quality_suffix, str):
            raise ValueError(f"quality_suffix must be a string, got {quality_suffix!r}")
        if negative_prompt is not None and not isinstance(negative_prompt, (str, list, tuple)):
            raise ValueError(f"negative_prompt must be a string, token ids or None, got "
                             f"{negative_prompt!r}")
        self.quality_suffix = quality_suffix or ""
        self.negative_prompt = negative_prompt
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
        self._negative_ids = None
        if isinstance(negative_prompt, (list, tuple)):
            self._negative_ids = self._ids(list(negative_prompt), what="negative_prompt")

    def _ids(self, prompt, suffix: str | None = None, what: str = "prompt") -> torch.Tensor:  # noqa: ANN001
        if isinstance(prompt, str):
            if self.processor is None:
                raise ValueError(
                    "this Emu3 checkpoint ships no processor; pass prompts as lists of token ids"
                )
            rows, cols = self.grid
            suffix = self.quality_suffix if suffix is None else suffix
            ids = self.processor(  # the size header states this grid: "{rows}*{cols}"
                text=[prompt + suffix],
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
            raise ValueError(f"Emu3 {what}s are strings or lists of token ids, got {prompt!r}")
        if not (ids == self.boi_id).any():
            raise ValueError(
                f"an Emu3 {what} must contain the image-start token "
                f"(id {self.boi_id}) followed by the size and image tokens"
            )
        return ids.to(self.device)

    def check_prompts(self, prompts: list) -> None:
        for p in prompts:
            self._ids(p)

    def unconditional(self, ids: torch.Tensor) -> torch.Tensor:
        """The negative prompt's ids; with none (or no processor for a text one), the caption
        with its text (between the first token and the image-start token) as padding."""
        if self._negative_ids is not None:
            return self._negative_ids
        if isinstance(self.negative_prompt, str) and self.processor is not None:
            self._negative_ids = self._ids(self.negative_prompt, suffix="")
            return self._negative_ids
        boi = int((ids == self.boi_id).nonzero()[0, 0])
        out = ids.clone()
        out[1:boi] = self.pad_id
        return out

    def prefill(self, rows: torch.Tensor, cache) -> torch.Tensor:  # noqa: ANN001
        """-> the prompt's attention mask. Rows of unequal prompts come left-padded
        (PerImageCacheSession): the padding is hidden (a row's positions then start later by
        a constant, which rotary attention does not see)."""
        mask = ((rows != self.pad_id).long().cumsum(1) > 0).long()  # leading padding: 0
        self.hf.model(input_ids=rows, attention_mask=mask, past_key_values=cache, use_cache=True)
        return mask

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        rows, cols = self.grid
        codes = self.layout.image_tokens(tokens).to(self.device).view(-1, rows, cols)
        with torch.inference_mode():
            px = self.hf.model.vqmodel.decode(codes)
        return to_images(px)

    def token_embeddings(self) -> torch.Tensor:
        return self.hf.get_input_embeddings().weight[self.index_to_bpe].detach()
