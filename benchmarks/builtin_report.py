"""Quality report of the built-in model: tokenizer PSNR, codebook usage and perplexity, prompt
fidelity of AR samples (overall and per attribute) against chance, FID/KID of AR samples against
rendered scenes next to the floor at that sample size, where the target's entropy sits (by
image-detail quintile, and its rank correlation with detail), a guidance / temperature sweep,
and a picture grid of eight captions decoded with ar and csd.

    python benchmarks/builtin_report.py [--captions 32] [--out docs] [--sweep]

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
from speculaas.io import save_image, write_text
from speculaas.models.builtin import vq as vqlib
from speculaas.models.builtin.scenes import sample_scenes


def tokenizer_stats(model, n: int = 512) -> dict:  # noqa: ANN001
    images = np.stack([s.image for s in sample_scenes(n, seed=96_000_000)])
    tokens = torch.cat([vqlib.encode(model.vq, images[i : i + 128]) for i in range(0, n, 128)])
    recon = np.concatenate([vqlib.decode(model.vq, tokens[i : i + 128])
                            for i in range(0, n, 128)])
    mse = ((recon.astype(np.float64) - images) ** 2).mean()
    freq = torch.bincount(tokens.flatten(), minlength=model.vocab_size).double()
    p = freq[freq > 0] / freq.sum()
    return {"psnr_db": round(float(10 * np.log10(255**2 / mse)), 2),
            "codebook_used": int((freq > 0).sum()),
            "codebook_size": int(model.vocab_size),
            "codebook_perplexity": round(float(torch.exp(-(p * p.log()).sum())), 1),
            "images": n}


def entropy_facts(out, grid: tuple[int, int]) -> dict:  # noqa: ANN001
    """Where the target is uncertain: mean entropy (nats) per image-detail quintile of the AR
    images, and the Spearman correlation between a token's entropy and its patch's detail."""
    from scipy.stats import spearmanr

    details = [metrics.detail_map(np.asarray(im), grid) for im in out.images]
    ents = [e.numpy() for e in out.entropy]
    edges = metrics.quintile_edges(details)
    rho = spearmanr(np.concatenate([d.ravel() for d in details]),
                    np.concatenate([e.ravel() for e in ents])).statistic
    return {"mean_entropy_by_detail_quintile": [round(x, 3) for x in
                                                metrics.by_detail_quintile(details, ents, edges)],
            "spearman_entropy_vs_detail": round(float(rho), 3),
            "mean_entropy": round(float(np.mean(ents)), 3)}


def sampling_sweep(model, captions: list[str], rendered: list) -> list[dict]:  # noqa: ANN001
    """AR fidelity and FID for a few guidance scales and temperatures (same captions, seeds)."""
    rows = []
    for cfg_scale in (2.0, 3.0, 5.0):
        for temperature in (0.9, 1.0):
            out = sp.generate(model, captions, method="ar", seed=0, cfg_scale=cfg_scale,
                              temperature=temperature)
            rows.append({"cfg_scale": cfg_scale, "temperature": temperature,
                         "prompt_fidelity": round(metrics.prompt_fidelity(
                             model.judge, out.images, captions), 3),
                         "fid_vs_rendered": round(metrics.feature_distances(
                             model.judge, rendered, out.images)["fid"], 2)})
            print(rows[-1], flush=True)
    return rows


def grid_picture(model, captions: list[str], path: Path) -> dict:  # noqa: ANN001
    rows = []
    fps = {}
    for method in ("ar", "csd"):
        out = sp.generate(model, captions, method=method, seed=0, window=16)
        fps[method] = out.forward_passes.tolist()
        rows.append([im.resize((128, 128), Image.NEAREST) for im in out.images])
    w, h, top = 128 * len(captions), 128 * 2, 0
    canvas = Image.new("RGB", (w + 40, h + top), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (label, ims) in enumerate(zip(("ar", "csd"), rows, strict=True)):
        draw.text((4, top + r * 128 + 60), label, fill="black")
        for c, im in enumerate(ims):
            canvas.paste(im, (40 + c * 128, top + r * 128))
    save_image(canvas, path)
    write_text(path.with_suffix(".txt"),
               "\n".join(f"{i}: {c} | ar {fps['ar'][i]} fwd, csd {fps['csd'][i]} fwd"
                         for i, c in enumerate(captions)) + "\n")
    return fps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--captions", type=int, default=32)
    p.add_argument("--out", default="docs")
    p.add_argument("--sweep", action="store_true", help="also sweep CFG scale and temperature")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    model = sp.load_model("builtin")
    report = {"tokenizer": tokenizer_stats(model)}
    captions = builtin_set(args.captions)
    ar = sp.generate(model, captions, method="ar", seed=0)
    shuffled = captions[:]
    random.Random(0).shuffle(shuffled)
    # Two seeds per caption: with 32 images alone the standard error (~0.035) is as large as
    # the differences worth reporting.
    ar2 = sp.generate(model, captions, method="ar", seed=len(captions))
    images, caps2 = ar.images + ar2.images, captions + captions
    scores = metrics.fidelity_scores(model.judge, images, caps2)
    report["prompt_fidelity_ar"] = round(float(scores.mean()), 3)
    report["prompt_fidelity_ar_se"] = round(float(scores.std(ddof=1) / len(scores) ** 0.5), 3)
    report["prompt_fidelity_ar_per_seed"] = [
        round(metrics.prompt_fidelity(model.judge, im, captions), 3)
        for im in (ar.images, ar2.images)]
    report["prompt_fidelity_ar_by_attribute"] = {
        k: round(v, 3) for k, v in metrics.fidelity_by_attribute(model.judge, images,
                                                                 caps2).items()}
    report["entropy"] = entropy_facts(ar, model.grid)
    report["sampling"] = vars(model.defaults)
    report["prompt_fidelity_chance_shuffled"] = round(
        metrics.prompt_fidelity(model.judge, images, shuffled + shuffled), 3)
    heads = {"shape": 4, "colour": 6, "background": 6, "position": 3}
    chance = [1 / n for k, n in heads.items() if k in model.judge.heads]
    report["prompt_fidelity_chance_uniform"] = round(sum(chance) / len(chance), 3)
    rendered = [s.image for s in sample_scenes(500, seed=95_000_000)]
    held_out = [s.image for s in sample_scenes(len(images), seed=97_000_000)]
    report["ar_vs_rendered"] = metrics.feature_distances(model.judge, rendered, images)
    report["rendered_vs_rendered"] = metrics.feature_distances(model.judge, rendered, held_out)
    if args.sweep:
        report["sampling_sweep"] = sampling_sweep(model, captions[:16], rendered)
    report["grid_forward_passes"] = grid_picture(model, captions[:8], out / "builtin_grid.png")
    report["training"] = model.record.get("final", {})
    write_text(out / "builtin_report.json", json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
