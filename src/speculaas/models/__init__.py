"""Model adapters by name: `load_model("builtin")`, `load_model("tiny", vocab_size=8, ...)`,
`load_model("janus", "deepseek-community/Janus-Pro-7B", device="cuda", dtype="bfloat16")`."""

from __future__ import annotations

import importlib
import inspect

from .base import ImageModel, Layout, Session

# name -> (module, class, what a checkpoint path looks like; None: the model takes no path)
MODELS: dict[str, tuple[str, str, str | None]] = {
    "builtin": ("builtin.model", "BuiltinModel", "optional: a folder with builtin.safetensors"),
    "tiny": ("tiny", "TinyModel", None),
    "toy": ("tiny", "ToyModel", None),
    "janus": ("janus", "JanusModel", "a local folder or a hub name such as "
              "deepseek-community/Janus-Pro-1B"),
    "emu3": ("emu3", "Emu3Model", "a local folder or a hub name such as "
             "Emu3-community/Emu3-Gen-hf"),
    "lumina-mgpt": ("chameleon", "ChameleonModel", "a Chameleon-format folder such as "
                    "Lumina-mGPT-7B-768 (pixels: vqgan=DIR)"),
    "llamagen": ("llamagen", "LlamaGenModel", "a GPT checkpoint such as c2i_L_256.pt "
                 "(pixels: vq=vq_ds16_c2i.pt)"),
}
MODELS["chameleon"] = MODELS["anole"] = MODELS["lumina-mgpt"]


def check_device(device):  # noqa: ANN001, ANN201
    """A torch.device that exists here, or a ValueError saying why not."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU is available here; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) here")
    elif dev.type not in ("cpu", "mps"):
        raise ValueError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def load_model(name: str, path: str | None = None, **kwargs) -> ImageModel:
    """Load a model adapter by name. `path` is a local weights folder/file or hub name where the
    family takes one; keyword options go to the adapter (e.g. `device=`, `dtype=`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {sorted(MODELS)}")
    module, cls_name, hint = MODELS[name]
    if hint is None and path is not None:
        raise ValueError(f"the {name} model has random weights and takes no path")
    if hint is not None and path is None and name != "builtin" and "model" not in kwargs:
        raise ValueError(f"{name} needs a checkpoint: {hint}")
    if "device" in kwargs:
        kwargs["device"] = check_device(kwargs["device"])
    cls = getattr(importlib.import_module(f".{module}", __name__), cls_name)
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"bad option(s) {unknown} for model {name!r}; valid: {params}")
    return cls(path, **kwargs) if hint is not None else cls(**kwargs)


__all__ = ["ImageModel", "Layout", "Session", "MODELS", "load_model"]
