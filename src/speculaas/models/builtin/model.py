"""The built-in text-to-image model: scene captions -> 16x16 VQ tokens -> 64x64 RGB."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file

from ...config import SamplingConfig
from ..base import (
    DraftIO,
    ImageModel,
    Layout,
    PrefixDecoderSession,
    Session,
    decoder_draft_io,
    resolve_dtype,
)
from ..transformer import Decoder, DecoderConfig
from . import vq as vqlib
from .judge import Judge, heads_in
from .scenes import WORDS, tokenize_caption

WEIGHTS_DIR = Path(__file__).parent / "weights"
WEIGHTS_FILE, RECORD_FILE = "builtin.safetensors", "training.json"
# Chosen on held-out captions: guidance 3 keeps the prompt's attributes, temperature 1 its
# variety; every benchmark in docs/ uses them. Guidance 2 draws a caption's one object alone
# more often at the same fidelity (docs/builtin.md, "Guidance and temperature").
DEFAULTS = SamplingConfig(temperature=1.0, top_k=None, top_p=None, cfg_scale=3.0)


def _load_part(module: torch.nn.Module, tensors: dict, prefix: str, source: Path) -> None:
    part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    expected = module.state_dict()
    missing = sorted(set(expected) - set(part))
    if missing:
        raise ValueError(f"{source}: missing {len(missing)} tensors for {prefix[:-1]}, "
                         f"e.g. {prefix}{missing[0]}")
    for k, v in part.items():
        if k in expected and expected[k].shape != v.shape:
            raise ValueError(f"{source}: {prefix}{k} has shape {tuple(v.shape)}, expected "
                             f"{tuple(expected[k].shape)}")
    module.load_state_dict(part, strict=False)


class BuiltinModel(ImageModel):
    name = "builtin"
    packed_forward = True

    def __init__(self, path: str | Path | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None) -> None:
        """`dtype`: of the transformer (e.g. "bfloat16": faster on CPUs with AMX or AVX-512
        BF16, and on GPUs); the tokenizer and judge stay in float32."""
        root = Path(path) if path is not None else WEIGHTS_DIR
        weights, record_path = root / WEIGHTS_FILE, root / RECORD_FILE
        for f in (weights, record_path):
            if not f.is_file():
                raise ValueError(f"built-in model file not found: {f} (expected {WEIGHTS_FILE} "
                                 f"and {RECORD_FILE}; `speculaas train --out DIR` makes them)")
        try:
            self.record = json.loads(record_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{record_path} is not valid JSON: {e}") from None
        needed = ("decoder_config", "vq_config")
        if not isinstance(self.record, dict) or not all(
                isinstance(self.record.get(k), dict) for k in needed):
            raise ValueError(f"{record_path} is not a training record of the built-in model "
                             f"(needs the objects {', '.join(needed)})")
        self.device = torch.device(device)
        try:
            tensors = load_file(str(weights))
        except Exception as e:  # safetensors raises its own error type for damaged files
            raise ValueError(f"{weights} cannot be read as safetensors (truncated or damaged?):"
                             f" {e}") from None
        with weights.open("rb") as f:  # names these weights in benchmark records
            digest = hashlib.sha256(f.read()).hexdigest()
        self.weights_id = digest[:16]
        recorded = self.record.get("weights_sha256")
        if recorded is not None and recorded != digest:
            raise ValueError(f"{weights} is damaged: its sha256 {digest[:16]}... is not the "
                             f"{str(recorded)[:16]}... recorded in {record_path} when it was "
                             "written (reinstall the package, or retrain)")
        try:
            self.decoder = Decoder(DecoderConfig(**self.record["decoder_config"]))
            self.vq = vqlib.build_vq(**self.record["vq_config"])
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"{record_path}: bad model configuration: {e}") from None
        self.judge = Judge(heads_in(tensors))
        for module, prefix in ((self.decoder, "ar."), (self.vq, "vq."), (self.judge, "judge.")):
            _load_part(module, tensors, prefix, weights)
            module.to(self.device).eval()
        if dtype is not None:
            self.decoder.to(resolve_dtype(dtype))
        self.vocab_size = self.decoder.cfg.vocab_out
        self.layout = Layout.raster(16, 16)
        self.defaults = DEFAULTS

    def _prefix(self, prompts: list, null: bool) -> torch.Tensor:
        for p in prompts:
            if p is not None and not isinstance(p, str):
                raise ValueError(f"the built-in model takes caption strings or None, got {p!r}")
        return torch.tensor([tokenize_caption(p, null=null) for p in prompts], device=self.device)

    def check_prompts(self, prompts: list) -> None:
        self._prefix(prompts, null=False)

    def admit(self, session, rows: list[int], prompts: list) -> None:  # noqa: ANN001
        session.admit(rows, self._prefix(prompts, null=False),
                      self._prefix(prompts, null=True) if session.cfg else None)

    def start(self, prompts: list, *, cfg: bool) -> Session:
        null = self._prefix(prompts, null=True) if cfg else None
        return PrefixDecoderSession(self.decoder, self._prefix(prompts, null=False), null,
                                    token_offset=len(WORDS))

    def decode(self, tokens: torch.Tensor) -> list[Image.Image]:
        pixels = vqlib.decode(self.vq, self.layout.image_tokens(tokens))
        return [Image.fromarray(p) for p in pixels]

    def token_embeddings(self) -> torch.Tensor:
        return self.decoder.embed.weight[len(WORDS):].detach()

    def draft_io(self) -> DraftIO:
        return decoder_draft_io(self.decoder, len(WORDS), f"builtin-{self.weights_id}")

    def codebook(self) -> torch.Tensor:
        return vqlib.codebook(self.vq).detach()
