"""Prompt sets for `speculaas bench`: plain text, TSV/CSV with a caption column, MS-COCO caption
JSON, or a built-in set of scene captions."""

from __future__ import annotations

import csv
import json
from pathlib import Path

BUILTIN_SET_SEED = 90_000_000  # scenes never seen in training (training seeds are below 4e7)


def builtin_set(n: int) -> list[str]:
    from ..models.builtin.scenes import render_scene

    return [render_scene(BUILTIN_SET_SEED + i).caption for i in range(n)]


def load_prompts(source: str, limit: int | None = None, model_name: str = "builtin") -> list:
    """Prompts from `source`: "builtin-set" (scene captions), "classes" (class ids 0..9 for the
    tiny model), or a file: .txt (one per line), .tsv/.csv (a column named caption, prompt or
    text), .json (MS-COCO captions: the caption with the smallest id of each image, images in
    id order)."""
    if source == "builtin-set":
        return builtin_set(limit or 32)
    if source == "classes":
        return list(range(limit or 10))
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (or use 'builtin-set')")
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".csv"):
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
        column = next((c for c in ("caption", "prompt", "text", "Prompt")
                       if rows and c in rows[0]), None)
        if column is None:
            raise ValueError(f"{path}: no caption/prompt/text column in "
                             f"{list(rows[0]) if rows else 'an empty file'}")
        prompts = [r[column].strip() for r in rows if r[column].strip()]
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
            raise ValueError(f"{path}: not an MS-COCO captions file (no 'annotations' list)")
        first: dict[int, tuple[int, str]] = {}
        for n, a in enumerate(data["annotations"]):
            if not (isinstance(a, dict) and isinstance(a.get("caption"), str)
                    and "image_id" in a and "id" in a):
                raise ValueError(f"{path}: annotation {n} lacks image_id, id or caption; "
                                 "MS-COCO caption entries have all three")
            key = a["image_id"]
            if key not in first or a["id"] < first[key][0]:
                first[key] = (a["id"], a["caption"].strip())
        prompts = [first[k][1] for k in sorted(first)]
    else:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                   if line.strip()]
    if model_name == "tiny":
        prompts = [int(p) for p in prompts]
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts[:limit] if limit else prompts
