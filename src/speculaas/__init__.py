"""speculaas: fast autoregressive image generation with content-aware speculative decoding."""

from __future__ import annotations

import importlib

from .config import METHODS, JacobiConfig, SamplingConfig

__version__ = "0.1.0"
__all__ = ["METHODS", "GenerationOutput", "JacobiConfig", "SamplingConfig", "acceptance",
           "generate", "load_model"]

# torch and transformers load on first use, so `speculaas --help` answers at once.
_LAZY = {"acceptance": (".acceptance", None), "generate": (".api", "generate"),
         "GenerationOutput": (".api", "GenerationOutput"), "load_model": (".models", "load_model")}


def __getattr__(name: str):  # noqa: ANN202
    if name not in _LAZY:
        raise AttributeError(f"module 'speculaas' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module, __name__)
    return value if attr is None else getattr(value, attr)
