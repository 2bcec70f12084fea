"""Prompts given as text (a command line, a server's JSON) -> what the adapters take."""

from __future__ import annotations

from pathlib import Path

# Models whose prompts are class ids: a digit string is one.
CLASS_ID_MODELS = ("tiny", "llamagen")


def parse_prompt(model_name: str, text: str, files: bool = True):  # noqa: ANN201
    """'none' -> None; 'ids:1,2,3' -> token ids; a digit string -> class id (tiny, llamagen
    c2i); 'FILE.pt' -> a tensor (LlamaGen t2i caption embeddings; only with `files`, never for
    a server's clients); anything else -> text."""
    if text.lower() == "none":
        return None
    if text.startswith("ids:"):
        try:
            return [int(t) for t in text[4:].split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"bad token ids in {text!r}; use ids:1,2,3") from None
    if files and text.endswith(".pt") and Path(text).is_file():
        import torch

        return torch.load(text, map_location="cpu", weights_only=True)
    if model_name in CLASS_ID_MODELS and text.strip().isdigit():
        return int(text)
    if model_name == "tiny":
        raise ValueError(f"the tiny model takes class ids as prompts, got {text!r}")
    return text
