"""Model adapters by name: `load_model("builtin")`, `load_model("tiny", vocab_size=8, ...)`."""

from __future__ import annotations

import inspect

from .base import ImageModel, Layout, Session


def _builtin(path=None, **kw):  # noqa: ANN001, ANN202
    from .builtin.model import BuiltinModel
    return BuiltinModel(path, **kw)


def _tiny(**kw):  # noqa: ANN202
    from .tiny import TinyModel
    return TinyModel(**kw)


def _toy(**kw):  # noqa: ANN202
    from .tiny import ToyModel
    return ToyModel(**kw)


def _janus(path=None, **kw):  # noqa: ANN001, ANN202
    if path is None:
        raise ValueError("janus needs a checkpoint: a local folder or a hub name such as "
                         "deepseek-community/Janus-Pro-1B")
    from .janus import JanusModel
    return JanusModel(path, **kw)


def _emu3(path=None, **kw):  # noqa: ANN001, ANN202
    if path is None:
        raise ValueError("emu3 needs a checkpoint: a local folder or a hub name such as "
                         "Emu3-community/Emu3-Gen-hf")
    from .emu3 import Emu3Model
    return Emu3Model(path, **kw)


def _chameleon(path=None, **kw):  # noqa: ANN001, ANN202
    if path is None:
        raise ValueError("lumina-mgpt needs a checkpoint: a local folder or a hub name such as "
                         "Alpha-VLLM/Lumina-mGPT-7B-768 (in transformers' Chameleon format)")
    from .chameleon import ChameleonModel
    return ChameleonModel(path, **kw)


def _llamagen(path=None, **kw):  # noqa: ANN001, ANN202
    if path is None:
        raise ValueError("llamagen needs a GPT checkpoint path such as c2i_L_256.pt "
                         "(and vq='vq_ds16_c2i.pt' for pixels)")
    from .llamagen import LlamaGenModel
    return LlamaGenModel(path, **kw)


MODELS = {"builtin": _builtin, "tiny": _tiny, "toy": _toy, "janus": _janus, "emu3": _emu3,
          "lumina-mgpt": _chameleon, "chameleon": _chameleon, "anole": _chameleon,
          "llamagen": _llamagen}


def load_model(name: str, path: str | None = None, **kwargs) -> ImageModel:
    """Load a model adapter by name. `path` is a local weights folder or hub name where the
    family takes one; keyword options go to the adapter (e.g. `device=`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {sorted(MODELS)}")
    if path is not None:
        if name in ("tiny", "toy"):
            raise ValueError(f"the {name} model has random weights and takes no path")
        kwargs["path"] = path
    try:
        return MODELS[name](**kwargs)
    except TypeError as e:
        from .tiny import TinyModel, ToyModel
        cls = {"tiny": TinyModel, "toy": ToyModel}.get(name)
        valid = ([p for p in inspect.signature(cls.__init__).parameters if p != "self"] if cls
                 else ["path", "device"])
        raise ValueError(f"bad option for model {name!r}: {e}; valid: {valid}") from None


__all__ = ["ImageModel", "Layout", "Session", "MODELS", "load_model"]
