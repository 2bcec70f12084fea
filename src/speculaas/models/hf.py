"""Shared pieces of the transformers-backed adapters: family checks, cache rollback, and a
session that keeps one `DynamicCache` per image so each image advances on its own."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import DraftIO, Session, resolve_dtype, weights_fingerprint


def rollback(cache, length: int) -> None:  # noqa: ANN001
    """Crop a transformers cache to `length` tokens. Portable across 4.x/5.x: only ever calls
    `crop` with a negative count (the tokens to drop), never crop(0) or crop(+n)."""
    drop = length - int(cache.get_seq_length())
    if drop < 0:
        cache.crop(drop)


def load_checkpoint(cls, path: str, model_type: str, dtype, **kwargs):  # noqa: ANN001, ANN201
    """`cls.from_pretrained(path, **kwargs)` after checking the folder holds a `model_type`
    checkpoint; every failure becomes a ValueError naming the path and what was expected."""
    local = Path(path)
    if local.exists() and not (local / "config.json").is_file():
        raise ValueError(f"{local / 'config.json'} not found: expected a {model_type} "
                         "checkpoint folder (config.json + model.safetensors)")
    from transformers import AutoConfig

    try:
        found = AutoConfig.from_pretrained(path, trust_remote_code=False).model_type
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a {model_type} config from {path!r}: {e}") from None
    if found != model_type:
        raise ValueError(f"{path!r} holds a {found!r} model, expected {model_type!r}")
    dtype = resolve_dtype(dtype)
    try:
        return cls.from_pretrained(path, dtype=dtype, trust_remote_code=False, **kwargs)
    except (OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"cannot load {model_type} weights from {path!r}: {e}") from None


def checkpoint_or_model(cls, path, model, model_type: str, dtype):  # noqa: ANN001, ANN201
    """The transformers model to wrap: `model` as given (already in memory), or loaded from
    `path`. Exactly one of the two; a model of the wrong class is refused."""
    if model is not None:
        if path is not None:
            raise ValueError(f"{model_type}: pass a checkpoint path or model=, not both")
        if not isinstance(model, cls):
            raise ValueError(f"{model_type}: model= must be a transformers {cls.__name__}, got "
                             f"{type(model).__name__}")
        return model.eval()
    if path is None:
        raise ValueError(f"{model_type} needs a checkpoint (a local folder or hub name) or an "
                         "already loaded model=")
    return load_checkpoint(cls, str(path), model_type, dtype).eval()


def checkpoint_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` as a checkpoint folder (or hub name, from the local cache) stores
    them: model.safetensors, or the shards its index names."""
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(path, "model.safetensors.index.json",
                        _raise_exceptions_for_missing_entries=False)
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = {n: cached_file(path, weight_map[n]) for n in names}
    else:
        single = cached_file(path, "model.safetensors")
        files = dict.fromkeys(names, single)
    out = {}
    for name, file in files.items():
        with safe_open(file, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def processor_for(path, processor):  # noqa: ANN001, ANN201
    """The processor given, else the checkpoint's own (None when it has none)."""
    if processor is not None:
        return processor
    return load_processor(str(path)) if path is not None else None


def load_processor(path: str):  # noqa: ANN201
    """The checkpoint's processor, or None when it ships no tokenizer."""
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _guidance_rows(cond: torch.Tensor, uncond: torch.Tensor, pad_id: int) -> torch.Tensor:
    """[2, n]: the conditional and unconditional prompts, the shorter left-padded (a model
    whose unconditional row may differ in length hides the padding in `prefill`)."""
    n = max(len(cond), len(uncond))
    return torch.stack([torch.nn.functional.pad(r, (n - len(r), 0), value=pad_id)
                        for r in (cond, uncond)])


class PerImageCacheSession(Session):
    """One cache per image holding its conditional (and unconditional) row.

    The model supplies `unconditional(ids)` (of any length: the shorter row is left-padded with
    `pad_id`), `prefill(rows, cache) -> state` and
    `window_hidden(inputs [rows, L], prompt_end [rows] or None, cache, state) -> [rows, L, dim]`
    (`state` is whatever prefill returned for that image, e.g. a prompt attention mask),
    `head_logits(hidden) -> [..., vocab]` and `embed_image_tokens(tokens) -> [..., dim]` (the
    last two also serve a trained draft head: `draft_io`). With `record_features` the hidden
    states of every slot are kept in `features`.
    Before each window the image's cache is cropped to its committed prefix.
    """

    def __init__(self, model, prompts: list[torch.Tensor], cfg: bool) -> None:  # noqa: ANN001
        self.model, self.cfg = model, cfg
        self.batch_size = len(prompts)
        self.caches, self.prompt_len, self.last, self.state = [], [], [], []
        for ids in prompts:
            for part, value in zip((self.caches, self.state, self.prompt_len, self.last),
                                   self._open(ids), strict=True):
                part.append(value)

    @torch.inference_mode()
    def _open(self, ids: torch.Tensor | None) -> tuple:
        """(cache, state, prompt length, last prompt tokens) of one image's prompt ids; None:
        an empty row, waiting to be admitted (a server's batch before its requests come)."""
        from transformers import DynamicCache

        if ids is None:
            return None, None, 0, None
        model = self.model
        rows = (_guidance_rows(ids, model.unconditional(ids), model.pad_id) if self.cfg
                else ids[None])
        cache = DynamicCache(config=model.text_config)
        state = model.prefill(rows[:, :-1], cache) if rows.shape[1] > 1 else None
        return cache, state, rows.shape[1], rows[:, -1]  # the last token opens the window

    def admit(self, rows: list[int], prompts: list[torch.Tensor]) -> None:
        """Continuous batching: images `rows` start over with new prompt ids (each image has
        its own cache, so the others are untouched)."""
        for i, ids in zip(rows, prompts, strict=True):
            self.caches[i], self.state[i], self.prompt_len[i], self.last[i] = self._open(ids)

    def context_length(self) -> int:
        return max(self.prompt_len)

    @torch.inference_mode()
    def forward(self, inputs, offset, images, max_offset=None):  # noqa: ANN001, ANN201
        cond, uncond, feats = [], [], []
        for row, (i, n) in enumerate(zip(images.tolist(), offset.tolist(), strict=True)):
            rollback(self.caches[i], self.prompt_len[i] - 1 + n)
            rows = inputs[row].expand(len(self.last[i]), -1)
            hidden = self.model.window_hidden(rows, self.last[i] if n == 0 else None,
                                              self.caches[i], self.state[i])
            feats.append(hidden)
            logits = self.model.head_logits(hidden).float()
            cond.append(logits[0])
            if len(logits) == 2:
                uncond.append(logits[1])
        if self.record_features:
            self.features = (torch.stack([f[0] for f in feats]),
                             torch.stack([f[1] for f in feats]) if uncond else None)
        return torch.stack(cond), (torch.stack(uncond) if uncond else None)


class PerImageCacheModel:
    """What the transformers adapters share over PerImageCacheSession: `start` and `admit`
    from the adapter's `_ids(prompt) -> prompt ids`. A None prompt (these models have no
    unconditional generation; check_prompts refuses it) starts an empty row for `admit`."""

    def start(self, prompts: list, *, cfg: bool) -> Session:
        return PerImageCacheSession(self, [None if p is None else self._ids(p)
                                           for p in prompts], cfg)

    def admit(self, session: Session, rows: list[int], prompts: list) -> None:
        session.admit(rows, [self._ids(p) for p in prompts])

    def draft_io(self) -> DraftIO:
        """A trained draft head reads the last hidden states, embeds tokens as the model does
        and turns its features into logits with the model's own output head."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = weights_fingerprint(self.name, self.hf)
        weight = self.hf.get_input_embeddings().weight
        return DraftIO(dim=weight.shape[1], embed=self.embed_image_tokens,
                       logits=lambda h: self.head_logits(h).float(),
                       fingerprint=self._fingerprint, dtype=weight.dtype)


class SharedVocabularyModel(PerImageCacheModel):
    """Adapters whose image tokens live in the text model's vocabulary (Lumina-mGPT/Chameleon,
    Emu3): `index_to_bpe` maps our image-token index to the model's id, for its input
    embedding and for the rows of its output head."""

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(self.index_to_bpe[tokens])

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's rows of the image tokens (and the row end): hidden -> logits."""
        return self.hf.lm_head(hidden)[..., self.index_to_bpe]

    def window_hidden(self, inputs: torch.Tensor, prompt_end: torch.Tensor | None, cache,  # noqa: ANN001
                      prompt_mask: torch.Tensor | None) -> torch.Tensor:
        """The text model's last hidden states over a window of image tokens [rows, L] (the
        first replaced by the last prompt token `prompt_end` when the window opens the image),
        after the cached prefix; prompt_mask (prefill's state): the guidance rows' left padding,
        extended over the cached image tokens and the window."""
        ids = self.index_to_bpe[inputs].clone()
        if prompt_end is not None:
            ids[:, 0] = prompt_end
        mask = None
        if prompt_mask is not None:
            past = int(cache.get_seq_length())
            mask = torch.ones(len(ids), past + ids.shape[1], dtype=torch.long, device=ids.device)
            mask[:, : prompt_mask.shape[1]] = prompt_mask
        return self.hf.model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                             use_cache=True).last_hidden_state
