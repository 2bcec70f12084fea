"""Sample-exact lossless decoding against the classic ratio test, side by side in one run.

    python benchmarks/exact.py [--prompts 32] [--seeds 2] [--windows 16,32,64,auto]
        [--dtypes float32,bfloat16] [--model builtin]

For every (caption, seed) pair, one image at a time and interleaved (every variant on a pair
before the next pair): ar, sjd with Gumbel verification (the default; default drafting) and
sjd with the ratio test and the best lossless drafting of docs/benchmarks.md (fresh slots from
the row above, maximal coupling), at each window. Prints per variant the mean forward passes,
the median latency ratio to AR on the same pair, and the share of images identical to AR's;
for each dtype after the first (bfloat16: window and single-token forwards round differently)
the same share and, for the images that differ, the first differing token (raster index).
Last line: a JSON of those numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import speculaas as sp
from speculaas.bench.prompts import load_prompts

VARIANTS = {"gumbel": {"verify": "gumbel"},
            "ratio": {"verify": "ratio", "draft_init": "vertical", "coupling": "maximal"}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--windows", default="16,32,64,auto")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args(argv)
    windows = [w if w == "auto" else int(w) for w in args.windows.split(",")]
    prompts = load_prompts("builtin-set", args.prompts, args.model)
    pairs = [(c, s) for s in range(args.seeds) for c in prompts]
    report: dict = {}
    for d_i, dtype in enumerate(args.dtypes.split(",")):
        model = sp.load_model(args.model, dtype=dtype)
        names = [(v, w) for w in windows for v in (VARIANTS if d_i == 0 else ("gumbel",))]
        forwards = {n: [] for n in names}
        ratio = {n: [] for n in names}
        same = {n: 0 for n in names}
        first_diff: dict = {n: [] for n in names}
        for i, (caption, seed) in enumerate(pairs):
            ar = sp.generate(model, [caption], method="ar", seed=seed, decode_images=False)
            order = names[i % len(names):] + names[: i % len(names)]  # rotate: drift hits all
            for v, w in order:
                out = sp.generate(model, [caption], method="sjd", seed=seed, window=w,
                                  decode_images=False, **VARIANTS[v])
                forwards[(v, w)].append(int(out.forward_passes[0]))
                ratio[(v, w)].append(ar.latency_s / out.latency_s)
                diff = (out.tokens[0] != ar.tokens[0]).nonzero()
                same[(v, w)] += int(len(diff) == 0)
                if len(diff):
                    first_diff[(v, w)].append(int(diff[0]))
            print(f"{dtype} {i + 1}/{len(pairs)}", flush=True)
        print(f"\n{args.model}, {dtype}, {len(pairs)} (caption, seed) pairs, batch 1")
        print("| variant | window | forwards | latency speed-up vs ar (median) | identical to ar "
              "| first differing token (median, min) |")
        print("|---|---|---|---|---|---|")
        for n in names:
            fd = first_diff[n]
            at = f"{statistics.median(fd):.0f}, {min(fd)}" if fd else "-"
            print(f"| sjd {n[0]} | {n[1]} | {statistics.mean(forwards[n]):.1f} | "
                  f"{statistics.median(ratio[n]):.2f}x | {same[n]}/{len(pairs)} | {at} |")
            report[f"{dtype}/{n[0]}/{n[1]}"] = {
                "forwards": statistics.mean(forwards[n]),
                "speedup": statistics.median(ratio[n]), "identical": same[n] / len(pairs),
                "first_diff": fd}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main()
