"""Lumina-mGPT, Anole and other Chameleon-family models through transformers'
`ChameleonForConditionalGeneration`.

Its `forward` masks image logits (text output only), so the adapter takes the hidden states
through `lm_head` and keeps the image-token columns, mapped to VQ codes through the vocabulary
mapping (`IMGIMG...Z` names). Lumina-mGPT's layout: the prompt ends with the image-start token
and the two size tokens; then every row of image tokens is followed by an end-of-line token
(forced, not speculated). CFG as Lumina-mGPT does it: the unconditional context starts at the
image-start token (left-padded and masked to the prompt's length, so both rows share one
cache). Default CFG 3, top-k 2000, 48x48 tokens (768x768).

Pixels come from the Chameleon VQGAN (`vqgan.ckpt` + `vqgan.yaml`), see `vqgan.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from PIL import Image

from ..config import SamplingConfig
from .base import ImageModel, Layout, to_images
from .hf import (
    SharedVocabularyModel,
    checkpoint_or_model,
    checkpoint_tensors,
    load_checkpoint,
    processor_for,
)

DEFAULTS = SamplingConfig(temperature=1.0, top_k=2000, top_p=None, cfg_scale=3.0)
EOL_NAME, IMAGE_START_NAME = "<reserved08799>", "<racm3:break>"


def load_lumina(path: str, dtype):  # noqa: ANN001, ANN201
    """A Lumina-mGPT checkpoint in transformers' layout or in the official one, whose q/k layer
    norms keep one row per model-parallel shard ([model_parallel_size, head_dim], the row shared
    by that shard's heads): those rows are repeated over the heads, as the official class does
    at run time. Any other shape that does not fit is refused, naming the tensor."""
    from transformers import ChameleonForConditionalGeneration

    model, info = load_checkpoint(ChameleonForConditionalGeneration, path, "chameleon", dtype,
                                  ignore_mismatched_sizes=True, output_loading_info=True)
    mismatched = {m[0]: m for m in info.get("mismatched_keys", [])}
    if not mismatched:
        return model.eval()
    params = dict(model.named_parameters())
    stored = checkpoint_tensors(path, list(mismatched))
    mp = int(getattr(model.config, "model_parallel_size", 1) or 1)
    for name, tensor in stored.items():
        target = params.get(name)
        per_shard = (target is not None and re.search(r"\.(q|k)_norm\.(weight|bias)$", name)
                     and tensor.dim() == 2 and tensor.shape[1] == target.shape[1]
                     and tensor.shape[0] in (mp, 1) and target.shape[0] % tensor.shape[0] == 0)
        if not per_shard:
            shape = None if target is None else tuple(target.shape)
            raise ValueError(f"{path}: tensor {name} has shape {tuple(tensor.shape)} in the "
                             f"checkpoint, the model expects {shape}")
        with torch.no_grad():
            target.copy_(tensor.repeat_interleave(target.shape[0] // tensor.shape[0], dim=0))
    return model.eval()


class ChameleonModel(SharedVocabularyModel, ImageModel):
    name = "lumina-mgpt"

    def __init__(self, path: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None, grid: tuple[int, int] = (48, 48),
                 vqgan: str | Path | None = None, eol_token: str = EOL_NAME,
                 image_start_token: str = IMAGE_START_NAME, model=None,  # noqa: ANN001
                 processor=None) -> None:  # noqa: ANN001
        from transformers import ChameleonForConditionalGeneration

        if model is None and path is not None:
            self.hf = load_lumina(str(path), dtype)
        else:
            self.hf = checkpoint_or_model(ChameleonForConditionalGeneration, path, model,
                                          "chameleon", dtype)
        self.device = torch.device(device)
        self.hf.to(self.device)
        vm = self.hf.model.vocabulary_mapping
        vocab = vm.vocab_map
        for name in (eol_token, image_start_token):
            if name not in vocab:
                raise ValueError(f"{path}: vocabulary has no {name!r} token")
        code2bpe = vm.img2bpe_mapping_tensor.long()
        self.codes = len(code2bpe)
        self.index_to_bpe = torch.cat([code2bpe, torch.tensor([vocab[eol_token]])]).to(self.device)
        self.vocab_size = self.codes + 1
        rows, cols = grid
        self.layout = Layout.with_row_end(rows, cols, self.codes)
        self.defaults = DEFAULTS
        self.boi_id = vocab[image_start_token]
        self.pad_id = self.hf.config.pad_token_id if self.hf.config.pad_token_id is not None else 1
        self.text_config = self.hf.config
        given = processor_for(None if model is not None else path, processor)
        self.tokenizer = getattr(given, "tokenizer", given)  # a processor or a tokenizer
        folder = Path(vqgan) if vqgan is not None else Path(path or ".") / "vqgan"
        self.vqgan = None
        if (folder / "vqgan.ckpt").exists() or vqgan is not None:
            from .vqgan import VQGANDecoder

            self.vqgan = VQGANDecoder.from_files(folder / "vqgan.ckpt",
                                                 folder / "vqgan.yaml").to(self.device)

    def text_prompt(self, caption: str) -> list[int]:
        """Lumina-mGPT's generation prompt for a caption, as its own code builds it:
        <bos> "Generate an image of {W}x{H} according to the following prompt:\n{caption}"
        <reserved08706> (end of turn), then the image-start token and the height and width
        tokens (<reserved0{8800 + n}> for n = pixels / 32), from which the image follows."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint ships no tokenizer: pass processor= (or a "
                             "tokenizer), or give prompts as token ids")
        rows, cols = self.grid
        vocab = self.hf.model.vocabulary_mapping.vocab_map
        names = ["<reserved08706>", f"<reserved{8800 + rows // 2:05d}>",
                 f"<reserved{8800 + cols // 2:05d}>"]
        missing = [n for n in names if n not in vocab]
        if missing:
            raise ValueError(f"the vocabulary has no {missing} token(s) needed for a "
                             f"{rows}x{cols} Lumina-mGPT prompt")
        text = (f"Generate an image of {16 * cols}x{16 * rows} according to the following "
                f"prompt:\n{caption}")
        body = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.hf.config.bos_token_id
        return ([bos] if bos is not None else []) + list(body) + [
            vocab[names[0]], self.boi_id, vocab[names[1]], vocab[names[2]]]

    def _ids(self, prompt) -> torch.Tensor:  # noqa: ANN001
        if isinstance(prompt, str):
            prompt = self.text_prompt(prompt)
        if not (isinstance(prompt, (list, tuple)) and prompt
                and all(isinstance(t, int) for t in prompt)):
            raise ValueError(f"Chameleon prompts are lists of token ids, got {prompt!r}")
        ids = torch.tensor(list(prompt), device=self.device)
        if not (ids == self.boi_id).any():
            raise ValueError(f"the prompt must contain the image-start token (id {self.boi_id}) "
                             "followed by the size tokens")
        return ids

    def check_prompts(self, prompts: list) -> None:
        for p in prompts:
            self._ids(p)

    def unconditional(self, ids: torch.Tensor) -> torch.Tensor:
        """The context from the image-start token on; the text before it becomes padding,
        which `attention_mask` hides."""
        boi = int((ids == self.boi_id).nonzero()[0, 0])
        out = ids.clone()
        out[:boi] = self.pad_id
        return out

    def prefill(self, rows: torch.Tensor, cache) -> torch.Tensor:  # noqa: ANN001
        """Returns the prompt's attention mask: the conditional row sees everything, the
        unconditional one only what follows its padding."""
        is_uncond = torch.arange(len(rows), device=rows.device)[:, None] > 0
        mask = (~is_uncond | (rows != self.pad_id)).long()
        self.hf.model(input_ids=rows, attention_mask=mask, past_key_values=cache, use_cache=True)
        return mask

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        if self.vqgan is None:
            raise ValueError("no VQGAN pixel decoder: pass vqgan=FOLDER holding vqgan.ckpt and "
                             "vqgan.yaml (Lumina-mGPT ships them under ckpts/chameleon/tokenizer)")
        rows, cols = self.grid
        codes = self.layout.image_tokens(tokens).to(self.device).view(-1, rows, cols)
        with torch.inference_mode():
            px = self.vqgan(codes)
        return to_images(px)

    def token_embeddings(self) -> torch.Tensor:
        return self.hf.get_input_embeddings().weight[self.index_to_bpe].detach()

    def codebook(self) -> torch.Tensor | None:
        return None if self.vqgan is None else self.vqgan.quantize.embedding.weight.detach()
