"""Batched decoding: per-image progress vs the batch-minimum strategy, at batch 1, 4 and 8.

    python benchmarks/batch_scaling.py [--images 16] [--model builtin]

Every configuration decodes the same images (same prompts, same per-image seeds) in one run.
Prints forward passes per image, step compression, its share of the batch-1 value, and wall time
per image; the last line is a JSON of the batch-8 / batch-1 step-compression ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import speculaas as sp
from speculaas.bench.prompts import builtin_set


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--model", default="builtin")
    p.add_argument("--batches", default="1,4,8")
    args = p.parse_args()
    model = sp.load_model(args.model)
    prompts = (builtin_set(args.images) if args.model == "builtin"
               else [i % 10 for i in range(args.images)])
    sp.generate(model, prompts[:2], method="sjd", decode_images=False)  # warm-up
    rows, base = [], {}
    for method in ("sjd", "csd"):
        for advance in ("per_image", "batch_min"):
            for bs in [int(b) for b in args.batches.split(",")]:
                fps, secs = [], 0.0
                for start in range(0, len(prompts), bs):
                    chunk = prompts[start : start + bs]
                    t0 = time.perf_counter()
                    out = sp.generate(model, chunk, method=method, seed=start, window=16,
                                      advance=advance, decode_images=False)
                    secs += time.perf_counter() - t0
                    fps += out.forward_passes.tolist()
                n_tok = out.tokens.shape[1]
                comp = statistics.mean(n_tok / f for f in fps)
                if bs == 1:
                    base[method] = comp
                rows.append((method, advance, bs, statistics.mean(fps), comp,
                             comp / base[method], secs / len(prompts)))
    print("| method | advance | batch | fwd passes / image | step compr. | vs batch 1 | "
          "s / image |")
    print("|---|---|---|---|---|---|---|")
    for m, a, b, f, c, r, s in rows:
        print(f"| {m} | {a} | {b} | {f:.1f} | {c:.2f}x | {100 * r:.0f} % | {s:.3f} |")
    last = max(int(b) for b in args.batches.split(","))
    print(json.dumps({f"{m}/{a}": round(r, 3) for m, a, b, f, c, r, s in rows if b == last}))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
