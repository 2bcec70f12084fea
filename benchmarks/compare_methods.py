"""Standard comparison on the built-in model: every method on the same prompts and seeds.

    python benchmarks/compare_methods.py [--prompts 32] [--seeds 2] [--out docs/bench]

Runs `speculaas bench` (ar, sjd, csd at delta 0.35/0.65/0.8, gsd, lantern, amplify, addition)
on the built-in prompt set, prints the table, and as its last line a JSON of ratios measured in
this run: step compression and latency speed-up of each variant relative to AR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculaas.bench.runner import BenchConfig, Variant, run

# Every method at the papers' window of 16, then sjd and csd(0.65) with the library's default
# window ("auto": compute-aware, plain AR where no window pays on this machine).
VARIANTS = ["ar", "sjd", "csd:delta=0.35", "csd:delta=0.65", "csd:delta=0.8", "gsd", "lantern",
            "amplify", "addition", "sjd:window=auto", "csd:delta=0.65:window=auto"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default="bench-out/compare")
    p.add_argument("--model", default="builtin")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    cfg = BenchConfig(model=args.model, prompts="builtin-set" if args.model == "builtin"
                      else "classes", limit=args.prompts, seeds=args.seeds,
                      variants=[Variant.parse(v) for v in VARIANTS], out=Path(args.out),
                      resume=args.resume, maps=4, window=16)
    summary = run(cfg)
    if summary is None:
        return
    print(summary["table"])
    ratios = {lab: {"step_compression": round(s["step_compression"], 3),
                    "latency_speedup": round(s["speedup_vs_ar"], 3),
                    **({"prompt_fidelity": round(s["prompt_fidelity"], 3)}
                       if "prompt_fidelity" in s else {})}
              for lab, s in summary["variants"].items()}
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
