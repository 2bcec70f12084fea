"""Steady-state tokens per iteration of each fixed window: the prior of `window="auto"`.

    python benchmarks/window_prior.py [--captions 16] [--seeds 2] [--tree 4,6]

Decodes captions that neither training nor the benchmarks use (built-in scenes 90,001,000 on)
with sjd and csd (delta 0.65), default drafting, at every candidate window of the auto policy,
and prints the mean committed tokens per iteration E(W) (= step compression) for each. A window
refines its drafts over the iterations before they are verified, so E(W) measured at a fixed W
is what a policy that settles on W gets; `decoding/window.py::PRIOR_TOKENS` holds the lossless
(sjd) row, rounded. The last line is the JSON of both rows. With --tree K,D the same for a
candidate tree at each width of decoding/tree.py::TREE_WIDTHS (`TREE_PRIOR_TOKENS`).
"""

from __future__ import annotations

import argparse
import json

import speculaas as sp
from speculaas.bench.prompts import BUILTIN_SET_SEED
from speculaas.decoding.tree import TREE_WIDTHS
from speculaas.decoding.window import CANDIDATES
from speculaas.models.builtin.scenes import render_scene


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--captions", type=int, default=16)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tree", default=None, help="K,D: measure this tree at TREE_WIDTHS instead")
    args = p.parse_args(argv)
    widths = CANDIDATES if args.tree is None else TREE_WIDTHS
    model = sp.load_model("builtin")
    captions = [render_scene(BUILTIN_SET_SEED + 1000 + i).caption for i in range(args.captions)]
    rows: dict[str, dict[int, float]] = {}
    for name, method, opts in (("sjd", "sjd", {}), ("csd(delta=0.65)", "csd", {"delta": 0.65})):
        rows[name] = {}
        for w in widths:
            fwd = 0
            for seed in range(args.seeds):
                out = sp.generate(model, captions, method=method, window=w,
                                  seed=[seed * 1000 + i for i in range(len(captions))],
                                  decode_images=False, tree=args.tree, **opts)
                fwd += int(out.forward_passes.sum())
            tokens = model.layout.length * len(captions) * args.seeds
            rows[name][w] = round(tokens / fwd, 3)
            print(f"{name:18s} W={w:3d}  tokens/iteration {rows[name][w]:.3f}", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
