"""Drafting comparison on the built-in model: rules x couplings x fresh-slot inits x windows.

    python benchmarks/drafting.py [--prompts 32] [--seeds 2] [--out bench-out/drafting]
        [--rules sjd,csd:delta=0.35,csd:delta=0.65,csd:delta=0.8] [--couplings none,maximal,gumbel]
        [--inits uniform,vertical] [--windows 16,32,64]

Runs `speculaas bench` with AR and every combination in one interleaved run (same prompts and
seeds for all), prints the table, the accepted-length histogram of the best lossless and best
relaxed variant, and as its last line a JSON of ratios measured in this run (step compression,
latency speed-up vs AR, prompt fidelity, FID vs rendered scenes and vs AR samples).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from speculaas.bench.runner import BenchConfig, Variant, run


def variants(rules: list[str], couplings: list[str], inits: list[str],
             windows: list[int]) -> list[Variant]:
    out = [Variant("ar")]
    for rule, coupling, init, window in itertools.product(rules, couplings, inits, windows):
        base = Variant.parse(rule)
        out.append(Variant(base.method, {**base.options, "coupling": coupling,
                                         "draft_init": init, "window": window}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default="bench-out/drafting")
    p.add_argument("--rules", default="sjd,csd:delta=0.35,csd:delta=0.65,csd:delta=0.8")
    p.add_argument("--couplings", default="none,maximal,gumbel")
    p.add_argument("--inits", default="uniform,vertical")
    p.add_argument("--windows", default="16,32,64")
    p.add_argument("--maps", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    vs = variants(args.rules.split(","), args.couplings.split(","), args.inits.split(","),
                  [int(w) for w in args.windows.split(",")])
    cfg = BenchConfig(model="builtin", prompts="builtin-set", limit=args.prompts,
                      seeds=args.seeds, variants=vs, out=Path(args.out), resume=args.resume,
                      maps=args.maps)
    summary = run(cfg)
    if summary is None:
        return
    print(summary["table"])
    stats = summary["variants"]
    lossless = [lab for lab in stats if lab.startswith("sjd")]
    relaxed = [lab for lab in stats if lab.startswith("csd")]
    for name, group in (("best lossless", lossless), ("best relaxed", relaxed)):
        if group:
            best = max(group, key=lambda lab: stats[lab]["step_compression"])
            print(f"{name}: {best}  accepted-length histogram {stats[best]['accept_hist']}")
    keys = ("step_compression", "speedup_vs_ar", "prompt_fidelity", "fid_vs_rendered", "fid_vs_ar")
    print(json.dumps({lab: {k: round(s[k], 3) for k in keys if s.get(k) is not None}
                      for lab, s in stats.items()}))


if __name__ == "__main__":
    main()
