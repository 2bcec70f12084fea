"""One-token iterations: the decoding loop at window 1 against the plain AR step, in one run.

    python benchmarks/one_token_step.py [--model builtin] [--batches 1,8] [--repeats 5]

Where no window pays (a compute-bound batch), the engine and window="auto" run one-token
iterations. This times a whole image's worth of them both ways on the same session and
prompts, interleaved: `Loop.step` at window 1 for sjd (Gumbel verification: the loop's AR step,
`Loop._ar_step`) and csd (the ratio test: drafting, verification and bookkeeping around a
one-token forward), and `AutoregressiveLoop.step` (the forward and a Gumbel argmax). Prints
the median seconds per image and the ratio loop / AR per batch size; last line JSON of the
ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import speculaas as sp
from speculaas.api import build_rule, resolve_sampling
from speculaas.bench.prompts import load_prompts
from speculaas.config import JacobiConfig
from speculaas.decoding.autoregressive import AutoregressiveLoop
from speculaas.decoding.frontier import Raster
from speculaas.decoding.loop import Loop
from speculaas.decoding.window import WindowPolicy


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model = sp.load_model(args.model)
    sampling = resolve_sampling(model, None, None, None, None)
    length = model.layout.length
    ratios = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = (load_prompts("builtin-set", batch, "builtin") if args.model == "builtin"
                   else list(range(batch)))
        gens = [torch.Generator(device=model.device).manual_seed(i) for i in range(batch)]
        times: dict[str, list[float]] = {"ar": [], "sjd": [], "csd": []}
        with torch.inference_mode():
            session = model.start(prompts, cfg=sampling.uses_cfg)
            loops = {m: Loop(model, session, build_rule(model, m), sampling,
                             JacobiConfig(window=1), Raster(model, WindowPolicy(1)), gens)
                     for m in ("sjd", "csd")}
            ar = AutoregressiveLoop(model, session, sampling, gens)
            for _ in range(args.repeats + 1):  # the first round warms up
                for name in times:
                    t0 = time.perf_counter()
                    if name == "ar":
                        for t in range(length):
                            ar.step(t)
                    else:
                        loop = loops[name]
                        loop.state = loop.new_state(gens)
                        while loop.step():
                            pass
                    times[name].append((time.perf_counter() - t0) / batch)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        for name in ("sjd", "csd"):
            ratios[f"{name}/b{batch}"] = round(med[name] / med["ar"], 3)
        print(f"batch {batch}: per image AR {med['ar']:.3f} s, loop at window 1: sjd "
              f"{med['sjd']:.3f} s ({med['sjd'] / med['ar']:.2f}x), csd {med['csd']:.3f} s "
              f"({med['csd'] / med['ar']:.2f}x)", flush=True)
    print(json.dumps(ratios))
    return ratios


if __name__ == "__main__":
    main()
