"""Two-dimensional windows against raster decoding on the built-in model, in one run.

    python benchmarks/rows.py [--prompts 32] [--seeds 2] [--out docs/bench-rows]

Runs `speculaas bench` with ar, sjd, csd (delta 0.35 / 0.65), gsd and lantern in raster order
and sjd / csd(0.65) with row_context c in {2, 4, 8}, on the same captions and seeds,
interleaved. Prints the bench table, then one line per variant set beside the targets (step
compression >= 4x; prompt fidelity within the noise of AR's, i.e. within two standard errors of
the difference; FID vs rendered scenes within 10 % of AR's), and as its last line a JSON of the
measured ratios.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from speculaas.bench.runner import BenchConfig, Variant, run

CONTEXTS = (2, 4, 8)
VARIANTS = ["ar", "sjd", "csd:delta=0.35", "csd:delta=0.65", "gsd", "lantern"] + [
    f"{m}:row_context={c}" for c in CONTEXTS for m in ("sjd", "csd:delta=0.65")]


def verdicts(summary: dict) -> dict:
    """Each variant's numbers next to AR's, with the three targets checked."""
    ar = summary["variants"]["ar"]
    out = {}
    for lab, s in summary["variants"].items():
        row = {"forward_passes": round(s["forward_passes_mean"], 1),
               "step_compression": round(s["step_compression"], 3),
               "latency_speedup": round(s["speedup_vs_ar"], 3)}
        if "prompt_fidelity" in s:
            noise = 2 * math.hypot(s["prompt_fidelity_se"] or 0, ar["prompt_fidelity_se"] or 0)
            row |= {"prompt_fidelity": round(s["prompt_fidelity"], 3),
                    "fidelity_delta": round(s["prompt_fidelity"] - ar["prompt_fidelity"], 3),
                    "fidelity_noise_2se": round(noise, 3)}
            if lab != "ar":
                row["fidelity_within_noise"] = abs(row["fidelity_delta"]) <= noise
        if "fid_vs_rendered" in s:
            row |= {"fid_vs_rendered": round(s["fid_vs_rendered"], 2),
                    "fid_vs_rendered_ratio": round(s["fid_vs_rendered"] / ar["fid_vs_rendered"],
                                                   3)}
            if "fid_vs_ar" in s:
                row["fid_vs_ar"] = round(s["fid_vs_ar"], 2)
        if lab != "ar":
            row["meets_targets"] = bool(row["step_compression"] >= 4
                                        and row.get("fidelity_within_noise", False)
                                        and row.get("fid_vs_rendered_ratio", math.inf) <= 1.10)
        out[lab] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default="bench-out/rows")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    cfg = BenchConfig(model="builtin", prompts="builtin-set", limit=args.prompts,
                      seeds=args.seeds, variants=[Variant.parse(v) for v in VARIANTS],
                      out=Path(args.out), resume=args.resume, maps=4, window=16)
    summary = run(cfg)
    if summary is None:
        return
    print(summary["table"])
    result = verdicts(summary)
    for lab, row in result.items():
        if lab == "ar":
            continue
        print(f"{lab:32s} {row['step_compression']:5.2f}x steps  "
              f"{row['latency_speedup']:5.2f}x wall  "
              f"fidelity {row.get('fidelity_delta', float('nan')):+.3f} "
              f"(noise +-{row.get('fidelity_noise_2se', float('nan')):.3f})  "
              f"FID/AR's {row.get('fid_vs_rendered_ratio', float('nan')):.2f}  "
              f"targets {'met' if row['meets_targets'] else 'missed'}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
