"""Wall-clock latency of every method against AR, measured side by side in one run.

    python benchmarks/gpu_latency.py --device cuda                     # built-in model on a GPU
    python benchmarks/gpu_latency.py --device cuda --model janus --weights PATH --dtype bfloat16
    python benchmarks/gpu_latency.py --model tiny --batches 1 --windows 4,auto --groups 2  # CPU
    python benchmarks/gpu_latency.py --device cpu --batches 1 --windows 32,64,128 --tree 4,6 \
        --cost-curve docs/trees/flat_curve.json      # trees, and the speed-up on a model curve
    python benchmarks/gpu_latency.py --device cuda --model emu3 --random   # an adapter's tiny
        # random checkpoint in its release's layout (janus, emu3, lumina-mgpt, llamagen)
    python benchmarks/gpu_latency.py --device cuda --drafter shipped       # + a trained head

For each batch size: ar, sjd (Gumbel verification and the ratio test) and csd (delta 0.35 /
0.65 / 0.8) with the default drafting, at
each window, on `--groups` different batches of prompts; the runs are interleaved (every variant
on a group before the next group) so machine drift hits all alike. Prints a table (median
latency per batch, forward passes per image, images per second, speed-up vs AR = median over the
groups and repeats of AR's latency / the variant's on the same prompts and seed, step
compression, mean window) and, as its last line, a JSON of those speed-ups. --tree K,D adds
sjd and csd(0.65) with that candidate tree at each window (the window is then the tree's width
budget). --cost-curve FILE ({"window": seconds}, window 0 an AR step) makes window=auto choose
from that curve and adds the speed-up each decode would have on it (its forwards at their
windows, against one AR step per token). --random writes the adapter's tiny random checkpoint
(models/random_checkpoints.py) to a temporary folder and times that, with its example prompts:
every adapter's code path on the device, no weights to download. --drafter HEAD adds sjd and
csd(0.65) with that trained draft head at each window.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

import speculaas as sp
from speculaas.bench.prompts import load_prompts
from speculaas.decoding.costs import load_cost_curve, modelled_seconds
from speculaas.decoding.window import AutoWindow

# sjd: Gumbel verification (the default, sample-exact); sjd(verify=ratio): the classic test.
RULES = [("sjd", {}), ("sjd", {"verify": "ratio"}), ("csd", {"delta": 0.35}),
         ("csd", {"delta": 0.65}), ("csd", {"delta": 0.8})]


def label(method: str, opts: dict, window) -> str:  # noqa: ANN001
    inner = ",".join([f"{k}={'head' if k == 'drafter' else v}" for k, v in opts.items()]
                     + [f"W={window}"])
    return f"{method}({inner})"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--weights", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompts", default=None, help="prompt set (default: the model's own)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--windows", default="16,32,64,auto")
    p.add_argument("--repeats", type=int, default=1, help="seeds per group")
    p.add_argument("--groups", type=int, default=8, help="batches of different prompts")
    p.add_argument("--tree", default=None, metavar="K,D", help="add sjd and csd with this tree")
    p.add_argument("--random", action="store_true",
                   help="time the adapter's tiny random checkpoint (no --weights)")
    p.add_argument("--drafter", default=None, metavar="HEAD",
                   help="add sjd and csd(0.65) with this draft head ('shipped': builtin's)")
    p.add_argument("--cost-curve", default=None, metavar="FILE",
                   help="a cost curve for window=auto and the modelled speed-up column")
    args = p.parse_args(argv)
    curve = None if args.cost_curve is None else load_cost_curve(args.cost_curve)
    opts = {"device": args.device} | ({"dtype": args.dtype} if args.dtype else {})
    source = args.prompts or ("builtin-set" if args.model == "builtin" else "classes")
    if args.random:
        import tempfile

        from speculaas.models.random_checkpoints import write_random_checkpoint

        ckpt = write_random_checkpoint(args.model, tempfile.mkdtemp(prefix="speculaas-random-"))
        model = ckpt.load(**opts)
        source = args.prompts or ckpt.prompts
    else:
        model = sp.load_model(args.model, args.weights, **opts)
    windows = [w if w == "auto" else int(w) for w in args.windows.split(",")]
    variants = [("ar", {}, 1)] + [(m, o, w) for w in windows for m, o in RULES]
    if args.tree:
        variants += [(m, {**o, "tree": args.tree}, w) for w in windows
                     for m, o in (("sjd", {}), ("csd", {"delta": 0.65}))]
    if args.drafter:
        from speculaas.drafter.head import load_head

        head = load_head(args.drafter, model)  # loaded once, refused here if not for `model`
        variants += [(m, {**o, "drafter": head}, w) for w in windows
                     for m, o in (("sjd", {}), ("csd", {"delta": 0.65}))]

    def policy(w):  # noqa: ANN001, ANN202
        return AutoWindow(cost=curve) if curve is not None and w == "auto" else w

    dev = model.device
    hardware = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                else platform.processor() or platform.machine())
    print(f"model {args.model} on {dev} ({hardware}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    rows, speedups = [], {}
    for batch in (int(b) for b in args.batches.split(",")):
        pool = (list(source) if isinstance(source, list)
                else load_prompts(source, batch * args.groups, args.model))
        pool = (pool * (batch * args.groups))[: batch * args.groups]
        groups = [pool[g * batch : (g + 1) * batch] for g in range(args.groups)]
        for method, o, w in variants:  # warm-up: caches, kernels, the auto window's cost curve
            sp.generate(model, groups[0], method=method, window=policy(w), decode_images=False,
                        **o)
        times = {i: [] for i in range(len(variants))}
        fwd = {i: [] for i in range(len(variants))}
        mean_window = {i: [] for i in range(len(variants))}
        modelled = {i: [] for i in range(len(variants))}
        for rep in range(args.repeats):
            for g, prompts in enumerate(groups):
                for i, (method, o, w) in enumerate(variants):
                    out = sp.generate(model, prompts, method=method, window=policy(w),
                                      seed=[rep * 10_000 + g * batch + j for j in range(batch)],
                                      decode_images=False, **o)
                    times[i].append(out.latency_s)
                    fwd[i].append(out.forward_passes.float().mean().item())
                    mean_window[i].append(out.mean_window.float().mean().item())
                    if curve is not None and method == "ar":
                        modelled[i].append(1.0)
                    elif curve is not None:  # the batch takes its slowest image's forwards
                        slowest = int(out.forward_passes.argmax())
                        ar_step = curve.get(0, curve.get(1))
                        modelled[i].append(model.layout.length * ar_step
                                           / modelled_seconds(curve, out.windows[slowest]))
        n_tokens = model.layout.grid[0] * model.layout.grid[1]
        for i, (method, o, w) in enumerate(variants):
            med = statistics.median(times[i])
            ratio = statistics.median(a / t for a, t in zip(times[0], times[i], strict=True))
            lab = label(method, o, w) if method != "ar" else "ar"
            speedups[f"{lab}@batch{batch}"] = round(ratio, 3)
            f = statistics.mean(fwd[i])
            model_sp = statistics.median(modelled[i]) if modelled[i] else None
            if model_sp is not None:
                speedups[f"{lab}@batch{batch}/modelled"] = round(model_sp, 3)
            rows.append((lab, batch, med, f, batch / med, ratio, n_tokens / f,
                         statistics.mean(mean_window[i]), model_sp))
    extra = " modelled speed-up |" if curve is not None else ""
    print("| variant | batch | latency med (s) | fwd / image | images/s | speed-up vs AR | "
          "step compr. | mean window |" + extra)
    print("|---|---|---|---|---|---|---|---|" + ("---|" if extra else ""))
    for lab, b, med, f, ips, sp_, sc, mw, msp in rows:
        print(f"| {lab} | {b} | {med:.3f} | {f:.1f} | {ips:.2f} | {sp_:.2f}x | {sc:.2f}x | "
              f"{mw:.1f} |" + (f" {msp:.2f}x |" if extra else ""))
    print(json.dumps(speedups))
    return speedups


if __name__ == "__main__":
    main()
