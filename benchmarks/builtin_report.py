"""Quality report of the built-in model: tokenizer PSNR and codebook usage, prompt fidelity of AR
samples against chance, FID/KID of AR samples against rendered scenes, and a picture grid of
eight captions decoded with ar and csd.

    python benchmarks/builtin_report.py [--captions 32] [--out docs]

Chance fidelity is measured, not assumed: the same AR images scored against the captions of
other images (shuffled), next to the uniform-guess value (mean of 1/4, 1/6, 1/6).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

import speculaas as sp
from speculaas.bench import metrics
from speculaas.bench.prompts import builtin_set
from speculaas.models.builtin import vq as vqlib
from speculaas.models.builtin.scenes import sample_scenes


def tokenizer_stats(model, n: int = 512) -> dict:  # noqa: ANN001
    images = np.stack([s.image for s in sample_scenes(n, seed=96_000_000)])
    tokens = torch.cat([vqlib.encode(model.vq, images[i : i + 128]) for i in range(0, n, 128)])
    recon = np.concatenate([vqlib.decode(model.vq, tokens[i : i + 128])
                            for i in range(0, n, 128)])
    mse = ((recon.astype(np.float64) - images) ** 2).mean()
    return {"psnr_db": round(float(10 * np.log10(255**2 / mse)), 2),
            "codebook_used": int(tokens.unique().numel()),
            "codebook_size": int(model.vocab_size), "images": n}


def grid_picture(model, captions: list[str], path: Path) -> dict:  # noqa: ANN001
    rows = []
    fps = {}
    for method in ("ar", "csd"):
        out = sp.generate(model, captions, method=method, seed=0)
        fps[method] = out.forward_passes.tolist()
        rows.append([im.resize((128, 128), Image.NEAREST) for im in out.images])
    w, h, top = 128 * len(captions), 128 * 2, 0
    canvas = Image.new("RGB", (w + 40, h + top), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (label, ims) in enumerate(zip(("ar", "csd"), rows, strict=True)):
        draw.text((4, top + r * 128 + 60), label, fill="black")
        for c, im in enumerate(ims):
            canvas.paste(im, (40 + c * 128, top + r * 128))
    canvas.save(path)
    (path.with_suffix(".txt")).write_text(
        "\n".join(f"{i}: {c} | ar {fps['ar'][i]} fwd, csd {fps['csd'][i]} fwd"
                  for i, c in enumerate(captions)) + "\n")
    return fps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--captions", type=int, default=32)
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    model = sp.load_model("builtin")
    report = {"tokenizer": tokenizer_stats(model)}
    captions = builtin_set(args.captions)
    ar = sp.generate(model, captions, method="ar", seed=0)
    shuffled = captions[:]
    random.Random(0).shuffle(shuffled)
    report["prompt_fidelity_ar"] = round(metrics.prompt_fidelity(model.judge, ar.images,
                                                                 captions), 3)
    report["prompt_fidelity_chance_shuffled"] = round(
        metrics.prompt_fidelity(model.judge, ar.images, shuffled), 3)
    report["prompt_fidelity_chance_uniform"] = round((1 / 4 + 1 / 6 + 1 / 6) / 3, 3)
    rendered = [s.image for s in sample_scenes(500, seed=95_000_000)]
    held_out = [s.image for s in sample_scenes(len(captions), seed=97_000_000)]
    report["ar_vs_rendered"] = metrics.feature_distances(model.judge, rendered, ar.images)
    report["rendered_vs_rendered"] = metrics.feature_distances(model.judge, rendered, held_out)
    report["grid_forward_passes"] = grid_picture(model, captions[:8], out / "builtin_grid.png")
    (out / "builtin_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
