"""Trained draft head against the training-free drafting on the built-in model, in one run.

    python benchmarks/drafter.py [--head shipped] [--captions 32] [--seeds 2]
        [--windows 4,8,16,64] [--rules sjd,csd:delta=0.35,csd:delta=0.65,csd:delta=0.8]
        [--latency-captions 8] [--latency-rounds 3]

Part 1 (step compression, at batch 32: an image's forwards do not depend on its batch): every
rule at every fixed window with and without the head, and the best training-free tree within
64 slots (4x6); per variant the step compression, the share of iterations by accepted drafts,
prompt fidelity and FID / KIDx1e3 against AR's images of the same captions and seeds, and the
speed-up modelled on a flat cost curve (a 7B target on a GPU: every window costs one AR step)
with the head's chain at `--head-cost` of an AR step per chain step (0.013: a 1024-wide head
and a 16,384-code output head over a 7B target, Janus-Pro's shape, memory-bound at batch 1).
Part 2 (CPU latency, float32, batch 1 and 8): AR and window="auto" with and without the head,
rounds interleaved, the median ratio to AR, and the head's share of the decode's time.
Part 3 (--skip takes it too): how the head is used, sjd at window 16 on 16 more held-out
captions: no head, and depth 1 / 2 / 4 with the head's law alone (head_blend 0) or times the
waiting draft's (0.5). benchmarks/drafter_ceiling.py gives the ceiling of a head of a given
agreement and depth.
The last line is a JSON of every number printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import speculaas as sp
from speculaas.bench.metrics import feature_distances, prompt_fidelity
from speculaas.bench.prompts import builtin_set
from speculaas.bench.runner import Variant
from speculaas.drafter.head import load_head


def decode(model, captions, seeds, method, opts, images=True):  # noqa: ANN001, ANN201
    return sp.generate(model, captions, method=method, seed=seeds, decode_images=images,
                       max_batch=32, **opts)


def modelled(out, depth: int, head_cost: float, length: int) -> float:  # noqa: ANN001
    """AR's time over the variant's on a flat curve: each forward one AR step, plus `depth`
    head steps at `head_cost` where a head drafts."""
    per = [n * (1.0 + depth * head_cost) for n in out.forward_passes.tolist()]
    return statistics.median(length / p for p in per)


def part1(model, head, args) -> list[dict]:  # noqa: ANN001
    caps = builtin_set(args.captions)
    captions = [c for c in caps for _ in range(args.seeds)]
    seeds = [1000 * i + s for i in range(len(caps)) for s in range(args.seeds)]
    ar = decode(model, captions, seeds, "ar", {})
    length = ar.tokens.shape[1]
    rows = []
    variants = []
    for rule in args.rules.split(","):
        v = Variant.parse(rule)
        for w in [int(x) for x in args.windows.split(",")]:
            variants.append((v.method, {**v.options, "window": w}, None))
            variants.append((v.method, {**v.options, "window": w}, head))
        variants.append((v.method, {**v.options, "window": 64, "tree": (4, 6)}, None))
        variants.append((v.method, {**v.options, "window": 64, "tree": (4, 6)}, head))
    for method, opts, h in variants:
        t0 = time.perf_counter()
        out = decode(model, captions, seeds, method, {**opts, "drafter": h})
        hist = out.accept_hist.sum(0).float()
        label = Variant(method, {k: ("x".join(map(str, v)) if isinstance(v, tuple) else v)
                                 for k, v in opts.items()}).label + (" +head" if h else "")
        dist = feature_distances(model.judge, ar.images, out.images)
        row = {"variant": label,
               "step_compression": round(float(out.step_compression.mean()), 2),
               "single_token_share": round(float(hist[0] / hist.sum()), 3),
               "accept_hist": [int(x) for x in hist.tolist()],
               "fidelity": round(prompt_fidelity(model.judge, out.images, captions), 3),
               "fid_vs_ar": round(dist["fid"], 1), "kid_x1000_vs_ar": round(dist["kid_x1000"], 1),
               "modelled_gpu": round(modelled(out, head.cfg.depth if h else 0, args.head_cost,
                                              length), 2),
               "same_as_ar": bool(torch.equal(out.tokens, ar.tokens)),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"| {row['variant']} | {row['step_compression']:.2f}x | "
              f"{100 * row['single_token_share']:.0f} % | {row['modelled_gpu']:.2f}x | "
              f"{row['fidelity']:.3f} | {row['fid_vs_ar']:.1f} | {row['kid_x1000_vs_ar']:.1f} | "
              f"{'yes' if row['same_as_ar'] else 'no'} |", flush=True)
    fid_ar = prompt_fidelity(model.judge, ar.images, captions)
    print(f"| ar | 1.00x | 100 % | 1.00x | {fid_ar:.3f} | 0.0 | 0.0 | yes |")
    rows.append({"variant": "ar", "fidelity": round(fid_ar, 3)})
    return rows


def part2(model, head, args) -> list[dict]:  # noqa: ANN001
    caps = builtin_set(args.captions + args.latency_captions)[args.captions:]
    variants = [("ar", {}, None), ("sjd", {}, None), ("sjd", {}, head),
                ("csd", {"delta": 0.65}, None), ("csd", {"delta": 0.65}, head)]
    rows = []
    for batch in (1, 8):
        groups = ([[c] for c in caps] if batch == 1
                  else [caps[i : i + 8] for i in range(0, len(caps), 8)])
        times = {i: [] for i in range(len(variants))}
        head_s = {i: 0.0 for i in range(len(variants))}
        for rnd in range(args.latency_rounds):
            for g, group in enumerate(groups):
                seeds = [7000 + 100 * g + j for j in range(len(group))]
                order = list(range(len(variants)))
                if rnd % 2:
                    order.reverse()  # interleaved, both orders
                for i in order:
                    method, opts, h = variants[i]
                    out = sp.generate(model, group, method=method, seed=seeds, window="auto"
                                      if method != "ar" else None, drafter=h,
                                      decode_images=False, profile=True, **opts)
                    times[i].append(out.latency_s)
                    head_s[i] += out.head_seconds
        ar_t = times[0]
        for i, (method, opts, h) in enumerate(variants):
            ratio = statistics.median(a / t for a, t in zip(ar_t, times[i], strict=True))
            label = Variant(method, opts).label + (" +head" if h else "")
            row = {"batch": batch, "variant": label, "speedup_vs_ar": round(ratio, 2),
                   "latency_median_s": round(statistics.median(times[i]), 3),
                   "head_share_pct": round(100 * head_s[i] / sum(times[i]), 1)}
            rows.append(row)
            print(f"| {batch} | {label} | {row['latency_median_s']:.3f} | "
                  f"{row['speedup_vs_ar']:.2f}x | {row['head_share_pct']:.1f} |", flush=True)
    return rows


def part3(model, head, args) -> list[dict]:  # noqa: ANN001
    caps = builtin_set(args.captions + args.latency_captions + 16)[-16:]
    seeds = list(range(100, 116))
    rows = []
    for depth, blend in [(None, None), (1, 0.0), (1, 0.5), (2, 0.0), (2, 0.5), (4, 0.0),
                         (4, 0.5)]:
        opts = {} if depth is None else {"drafter": head, "draft_depth": depth,
                                         "head_blend": blend}
        out = decode(model, caps, seeds, "sjd", {"window": 16, **opts}, images=False)
        hist = out.accept_hist.sum(0).float()
        row = {"depth": depth, "head_blend": blend,
               "step_compression": round(float(out.step_compression.mean()), 2),
               "single_token_share": round(float(hist[0] / hist.sum()), 3)}
        rows.append(row)
        print(f"| {depth or '-'} | {'-' if blend is None else blend} | "
              f"{row['step_compression']:.2f}x | {100 * row['single_token_share']:.0f} % |",
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", default="shipped")
    p.add_argument("--captions", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--windows", default="4,8,16,64")
    p.add_argument("--rules", default="sjd,csd:delta=0.35,csd:delta=0.65,csd:delta=0.8")
    p.add_argument("--head-cost", type=float, default=0.013,
                   help="one chain step in AR steps of a 7B target on a GPU (flat curve)")
    p.add_argument("--latency-captions", type=int, default=8)
    p.add_argument("--latency-rounds", type=int, default=3)
    p.add_argument("--skip", default="", help="parts to skip, e.g. part1,part3")
    args = p.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    model = sp.load_model("builtin")
    head = load_head(args.head, model)
    held = head.target.get("training", {}).get("heldout", {})
    print(f"head {args.head} ({head.head_id}), depth {head.cfg.depth}, stale {head.cfg.stale}; "
          f"{sum(x.numel() for x in head.parameters()) / 1e6:.2f} M parameters; held-out "
          f"agreement {held.get('agreement')}, after a rejection {held.get('after_rejection')}",
          flush=True)
    result = {"head": head.head_id, "depth": head.cfg.depth, "stale": head.cfg.stale}
    skip = set(args.skip.split(","))
    if "part1" not in skip:
        print("| variant | step compr. | single-token its | modelled GPU | fidelity | "
              "FID vs AR | KIDx1e3 vs AR | tokens = ar |\n|---|---|---|---|---|---|---|---|")
        result["compression"] = part1(model, head, args)
    if "part2" not in skip:
        print("\n| batch | variant | latency med (s) | speed-up vs AR | head % |\n"
              "|---|---|---|---|---|")
        result["latency"] = part2(model, head, args)
    if "part3" not in skip:
        print("\n| depth | head_blend | step compr. | single-token its |\n|---|---|---|---|")
        result["use"] = part3(model, head, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
