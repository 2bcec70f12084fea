"""`speculaas generate | train | bench` on the command line."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from .config import (
    COUPLINGS,
    DEFAULT_COUPLING,
    DEFAULT_DRAFT_INIT,
    DRAFT_INITS,
    METHODS,
    MODEL_NAMES,
    RULE_DEFAULTS,
    VERIFY_MODES,
    TrainConfig,
)
from .prompting import parse_prompt

# Adapters whose sessions record features (ImageModel.draft_io): the ones a head can run on.
DRAFTER_MODELS = ("builtin", "tiny", "llamagen", "janus", "lumina-mgpt", "chameleon", "anole",
                  "emu3")
# Adapters that admit requests into a running batch (ImageModel.admit): the ones a server runs.
SERVE_MODELS = tuple(n for n in MODEL_NAMES if n != "toy")
MAX_IMAGES = 10_000  # per CLI call; larger jobs belong in `speculaas bench` or a script


class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, except None (whose meaning the help text says itself)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


# The adapters' sampling defaults (models/*: DEFAULTS), as --help states them; the CLI tests
# check them against the adapters. None: off.
SAMPLING_DEFAULTS = {
    "builtin": {"temperature": 1.0, "top_k": None, "cfg_scale": 3.0},
    "janus": {"temperature": 1.0, "top_k": None, "cfg_scale": 5.0},
    "lumina-mgpt": {"temperature": 1.0, "top_k": 2000, "cfg_scale": 3.0},
    "emu3": {"temperature": 1.0, "top_k": 2048, "cfg_scale": 3.0},
    "llamagen c2i": {"temperature": 1.0, "top_k": 2000, "cfg_scale": 4.0},
    "llamagen t2i": {"temperature": 1.0, "top_k": 1000, "cfg_scale": 7.5},
}


def _model_defaults(option: str) -> str:
    """'builtin 3, janus 5, ...' for --help."""
    return ", ".join(f"{model} {'off' if d[option] is None else f'{d[option]:g}'}"
                     for model, d in SAMPLING_DEFAULTS.items())


RULE_FLAGS = {  # flag -> option name of the acceptance rules
    "lam": float, "delta": float, "filter": str, "group_size": int, "prob_threshold": float,
    "dist_threshold": float, "k": float, "eps": float,
}




# Adapter options that have flags of their own (a --model-opt would clash or silently win).
MODEL_OPT_FLAGS = {"path": "--weights", "weights": "--weights", "name": "--model",
                   "device": "--device", "dtype": "--dtype"}


def _model_options(args: argparse.Namespace) -> dict:
    opts = {"device": args.device}
    if args.dtype:
        opts["dtype"] = args.dtype
    for item in args.model_opt:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad --model-opt {item!r}; use KEY=VALUE")
        if key in MODEL_OPT_FLAGS:
            raise ValueError(f"--model-opt {key}=... clashes with {MODEL_OPT_FLAGS[key]}; "
                             f"use that flag")
        if key in opts:
            raise ValueError(f"--model-opt {key} given twice")
        if value[:1] in "{[":  # a structured option (e.g. vq_config) as JSON
            import json

            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"--model-opt {key}: bad JSON {value!r}") from None
        elif value.isdigit():
            value = int(value)
        elif "," in value and all(v.strip().isdigit() for v in value.split(",")):
            value = tuple(int(v) for v in value.split(","))
        opts[key] = value
    return opts


def _window(text: str):  # noqa: ANN202
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def _check_prompts_early(args: argparse.Namespace, prompts: list) -> None:
    """Refuse what can be refused before the model loads: captions the built-in grammar cannot
    parse, a number of images out of range, output files that cannot be written."""
    if not 1 <= args.num_images <= MAX_IMAGES:
        raise ValueError(f"--num-images must be in [1, {MAX_IMAGES}], got {args.num_images}")
    if len(prompts) > MAX_IMAGES:
        raise ValueError(f"{len(prompts)} images requested; at most {MAX_IMAGES} per call")
    if args.model == "builtin":
        from .models.builtin.scenes import parse_caption

        for p in prompts:
            if p is not None:
                try:
                    parse_caption(p)
                except ValueError as e:
                    raise ValueError(f"{e} (`speculaas captions` shows the grammar)") from None
    from .io import check_writable

    path = Path(args.out)
    check_writable(path)
    check_writable(path.with_name(path.stem + ".map.png"))


def _rule_options(args: argparse.Namespace) -> dict:
    opts = {k: getattr(args, k) for k in RULE_FLAGS if getattr(args, k) is not None}
    if "k" in opts and args.method == "lantern":
        opts["k"] = int(opts["k"])
    return opts


def cmd_serve_ray(args: argparse.Namespace) -> None:
    """`speculaas serve --ray`: every option checked before Ray starts."""
    import os

    if args.address is None and args.host in ("127.0.0.1", "localhost"):
        # A local cluster for a loopback server: Ray's single-machine mode binds its own
        # services to loopback too (read when ray is imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ValueError('--ray needs Ray Serve: pip install -e ".[ray]" -c constraints.txt'
                         ) from None
    from speculaas.serve.app import caller_policy
    from speculaas.serve.ray_app import RaySettings, serve_ray

    api_key, hosts = caller_policy(args.host, args.port, args.api_key)
    settings = RaySettings(
        model=args.model, weights=args.weights, model_options=_model_options(args),
        max_batch=args.max_batch, max_rows=args.max_rows, queue_size=args.queue,
        time_limit_s=args.time_limit, warm_up_s=args.warm_up, drafter=args.drafter,
        api_key=api_key, hosts=None if hosts is None else tuple(sorted(hosts)),
        replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        cpus=args.replica_cpus, gpus=args.replica_gpus)
    serve_ray(settings, args.host, args.port, args.address)


def add_model_flags(p: argparse.ArgumentParser, models: tuple[str, ...] = MODEL_NAMES,
                    model_help: str | None = None) -> None:
    """--model (one of `models`), --weights, --device, --dtype, --model-opt: what
    _model_options() and load_model() read."""
    p.add_argument("--model", default="builtin", choices=models, metavar="MODEL",
                   help=model_help or f"one of {', '.join(models)}")
    p.add_argument("--weights", default=None, help="local weights folder or hub name")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="e.g. bfloat16 (None: the weights' own)")
    p.add_argument("--model-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="adapter option, e.g. vq=vq_ds16_c2i.pt, image_size=384, grid=48,48")


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--window", type=_window, default=None,
                   help="slots per forward, or 'auto' (chosen every iteration from the cost of a "
                        "window: sjd learns this machine's while it decodes, relaxed rules use "
                        "the device kind's reference so a seed fixes the picture; plain AR where "
                        "none pays; nothing is timed before the first token). Default: auto, 16 "
                        "with --row-context")
    p.add_argument("--draft-init", default=DEFAULT_DRAFT_INIT, choices=DRAFT_INITS,
                   help="what fresh draft slots hold")
    p.add_argument("--coupling", default=DEFAULT_COUPLING, choices=COUPLINGS,
                   help="how tail slots become the next drafts (maximal/gumbel: coupled; "
                        "moot under --verify gumbel)")
    p.add_argument("--verify", default="gumbel", choices=VERIFY_MODES,
                   help="how exact rules (sjd; a relaxed one at zero relaxation) test drafts: "
                        "gumbel (the same tokens as ar for the same seed) or ratio (the classic "
                        "min(1, target/draft) test)")
    p.add_argument("--row-context", type=int, default=None, metavar="C",
                   help="two-dimensional window: a row starts once the row above has C "
                        "committed tokens (not lossless; None: raster order)")
    p.add_argument("--tree", default=None, metavar="K,D[,N]",
                   help="candidate tree at the head of every window: K candidates at each of up "
                        "to D positions, N off-chain nodes (default: the full tree, at most half "
                        "the window); the window is then the width budget. With --window auto "
                        "the tree runs only where the measured cost curve says it pays")
    p.add_argument("--drafter", default=None, metavar="DIR",
                   help="a trained draft head for this model (a folder from `speculaas "
                        "train-drafter`, or 'shipped': the built-in model's): it drafts the "
                        "head of every window from the target's own features; every rule keeps "
                        "its law")
    p.add_argument("--draft-depth", type=int, default=None, metavar="N",
                   help="slots the draft head drafts per window (None: the head's default)")
    p.add_argument("--head-blend", type=float, default=None, metavar="X",
                   help="a head's law times the slot's stale law to the power X (0: the head "
                        "alone; default 0.5, 0 for a head that reads the stale feature)")
    p.add_argument("--temperature", type=float, default=None,
                   help="None: the model's default (1 for every adapter)")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"None: the model's default ({_model_defaults('top_k')}); 0 switches "
                        "top-k off")
    p.add_argument("--top-p", type=float, default=None,
                   help="None: the model's default (off for every adapter)")
    p.add_argument("--cfg-scale", type=float, default=None,
                   help=f"None: the model's default ({_model_defaults('cfg_scale')}); 1 "
                        "switches CFG off")
    for name, typ in RULE_FLAGS.items():
        users = [f"{m} (default {opts[name]})" for m, opts in RULE_DEFAULTS.items()
                 if name in opts]
        p.add_argument(f"--{name.replace('_', '-')}", type=typ, default=None,
                       help=f"option of {', '.join(users)}")


def cmd_generate(args: argparse.Namespace) -> None:
    prompts = [parse_prompt(args.model, p) for p in args.prompt] * args.num_images
    _check_prompts_early(args, prompts)
    import speculaas as sp
    from speculaas.bench.maps import acceptance_figure
    from speculaas.io import save_image

    model = sp.load_model(args.model, args.weights, **_model_options(args))
    out = sp.generate(model, prompts, method=args.method, seed=args.seed, window=args.window,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      cfg_scale=args.cfg_scale, draft_init=args.draft_init,
                      coupling=args.coupling, row_context=args.row_context, progress=True,
                      verify=args.verify, tree=args.tree, drafter=args.drafter,
                      draft_depth=args.draft_depth, head_blend=args.head_blend,
                      **_rule_options(args))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    paths = [path] if len(prompts) == 1 else [
        path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(len(prompts))]
    for img, p in zip(out.images, paths, strict=True):
        save_image(img.resize((img.width * args.scale, img.height * args.scale), 0), p)
    distinct = list(dict.fromkeys(str(p) for p in prompts))
    titles = [(f"{textwrap.shorten(str(prompts[i]), 36)}\n" if len(distinct) > 1 else "")
              + f"{args.method}: {out.forward_passes[i]} forwards" for i in range(len(prompts))]
    fig = acceptance_figure(out.images, out.commit_step, out.entropy, titles,
                            caption=distinct[0] if len(distinct) == 1 else None)
    map_path = path.with_name(path.stem + ".map.png")
    save_image(fig, map_path)
    n = out.tokens.shape[1]
    for i, p in enumerate(paths):
        print(f"{p}: {int(out.forward_passes[i])} forward passes for {n} tokens, "
              f"step compression {float(out.step_compression[i]):.2f}x")
    print(f"latency {out.latency_s:.2f} s for {len(prompts)} image(s); map: {map_path}")
    if args.method != "ar" and args.window in (None, "auto") and args.row_context is None:
        mean = float(out.mean_window.mean())
        used: dict[int, int] = {}
        for per_image in out.windows:
            for w, n in per_image.items():
                used[w] = used.get(w, 0) + n
        print(f"window auto: mean {mean:.1f}" + (
            f" (plain AR: on this {model.device.type} at batch {len(prompts)} no window pays "
            "for its forward; --window 16 forces one)" if mean == 1.0 else
            "; forwards per window " + ", ".join(f"{w}: {n}" for w, n in sorted(used.items()))))


def cmd_bench(args: argparse.Namespace) -> None:
    from speculaas.bench.runner import BenchConfig, Variant, expand_sweeps, run
    from speculaas.decoding.costs import load_cost_curve

    variants = expand_sweeps([Variant.parse(m) for m in args.methods.split(",") if m.strip()],
                             args.sweep)
    if not variants:
        raise ValueError(f"--methods {args.methods!r} names no method; e.g. ar,sjd,csd")
    cfg = BenchConfig(model=args.model, weights=args.weights, device=args.device,
                      prompts=args.prompts, limit=args.limit or None, seeds=args.seeds,
                      variants=variants, window=args.window, out=Path(args.out),
                      resume=args.resume, maps=args.maps,
                      cost_curve=None if args.cost_curve is None else load_cost_curve(
                          args.cost_curve),
                      model_options={k: v for k, v in _model_options(args).items()
                                     if k != "device"})
    summary = run(cfg)
    if summary is not None:
        print(summary["table"])
        print(f"results, table.md, summary.json, pareto.png and maps/ in {cfg.out}")


def cmd_train_drafter(args: argparse.Namespace) -> None:
    if args.model not in DRAFTER_MODELS:
        raise ValueError(f"model {args.model!r} does not give a draft head its features yet "
                         f"(train-drafter runs on {', '.join(DRAFTER_MODELS)})")
    cfg = TrainConfig(images=args.images, batch=args.batch, steps=args.steps,
                      chains=args.chains, lr=args.lr, unroll=args.unroll, width=args.width,
                      blocks=args.blocks, depth=args.depth, stale=args.stale,
                      seed=args.seed, prior_prompts=args.prior_prompts)
    from .io import check_writable

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    check_writable(out / "head.json")
    prompts = None
    if args.prompts is not None:
        from speculaas.bench.prompts import load_prompts

        prompts = load_prompts(args.prompts, model_name=args.model)
    import speculaas as sp
    from speculaas.api import resolve_sampling
    from speculaas.drafter.train import train_drafter

    model = sp.load_model(args.model, args.weights, **_model_options(args))
    sampling = resolve_sampling(model, args.temperature, args.top_k, None, args.cfg_scale)
    folder = train_drafter(model, out, cfg, sampling, prompts)
    print(f"draft head in {folder} (head.safetensors, head.json); use it with "
          f"--drafter {folder}")


def cmd_captions() -> None:
    from .models.builtin.scenes import GRAMMAR, sample_scenes

    print("Captions of the built-in model (case and punctuation are ignored):\n")
    print(GRAMMAR.replace("; ", "\n"))
    print("\nalso read: no size (big, then small), 'in the center' / 'in the middle', the "
          "background first or left out (under a blue sky), e.g. 'a red circle in the middle "
          "over grass', 'at sunset, a blue square on the left and a green circle on the right'")
    print("\nexamples:")
    for scene in sample_scenes(5, seed=97_000_000):
        print(f"  {scene.caption}")


def main(argv: list[str] | None = None) -> None:
    from . import __doc__ as doc
    from . import __version__

    parser = argparse.ArgumentParser(prog="speculaas", description=doc)
    parser.add_argument("--version", action="version", version=f"speculaas {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images and their acceptance maps",
                       formatter_class=HELP)
    g.add_argument("--prompt", action="append", required=True,
                   help="caption, class id, ids:1,2,3 (token ids), FILE.pt (caption "
                        "embeddings) or 'none'; repeat for several. The built-in model's "
                        "captions: `speculaas captions`")
    g.add_argument("--num-images", type=int, default=1, help="images per prompt")
    g.add_argument("--method", default="csd", choices=METHODS, help="decoding method")
    g.add_argument("--seed", type=int, default=0, help="image i of the call uses seed + i")
    g.add_argument("--out", default="out.png", help="image path; the map goes to OUT.map.png")
    g.add_argument("--scale", type=int, default=4, help="upscale the saved PNG this many times")
    add_decoding_flags(g)

    b = sub.add_parser("bench", help="compare methods on a prompt set (speed, quality, maps)",
                       formatter_class=HELP)
    b.add_argument("--prompts", default="builtin-set",
                   help="builtin-set, classes (tiny), or a .txt/.tsv/.csv/COCO .json file")
    b.add_argument("--limit", type=int, default=32, help="use the first N prompts (0: all)")
    b.add_argument("--methods", default="ar,sjd,csd,gsd,lantern,amplify,addition",
                   help="comma-separated; options as csd:delta=0.35:lam=0.5 (decoding options "
                        "too: csd:row_context=4:window=8)")
    b.add_argument("--sweep", action="append", default=[],
                   help="METHOD.OPTION=V1,V2,... adds one variant per value")
    b.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    b.add_argument("--out", default="bench-out", help="results folder")
    b.add_argument("--resume", action="store_true", help="keep finished items, run the rest")
    b.add_argument("--maps", type=int, default=3, help="prompts to draw acceptance maps for")
    b.add_argument("--model", default="builtin", choices=MODEL_NAMES, metavar="MODEL",
                   help=f"one of {', '.join(MODEL_NAMES)}")
    b.add_argument("--weights", default=None, help="local weights folder or hub name")
    b.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    b.add_argument("--dtype", default=None, help="e.g. bfloat16 (None: the weights' own)")
    b.add_argument("--model-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="adapter option, e.g. vq=vq_ds16_c2i.pt, image_size=384, grid=48,48 "
                        "(as generate's)")
    b.add_argument("--window", type=_window, default=None,
                   help="default window of every variant (a variant's window= overrides it); "
                        "default: auto, 16 for variants with row_context")
    b.add_argument("--cost-curve", default=None, metavar="FILE",
                   help='JSON {"window": seconds} (window 0: an AR step), e.g. a GPU\'s from '
                        "benchmarks/gpu_latency.py or a flat model of one: window=auto chooses "
                        "from it and the table adds the speed-up modelled on it")

    d = sub.add_parser("demo", help="serve the local web demo", formatter_class=HELP)
    d.add_argument("--model", default="builtin", choices=MODEL_NAMES, metavar="MODEL",
                   help=f"one of {', '.join(MODEL_NAMES)}")
    d.add_argument("--weights", default=None, help="local weights folder or hub name")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    d.add_argument("--port", type=int, default=7860, help="port to serve on")
    d.add_argument("--drafter", default=None, metavar="DIR",
                   help="a draft head (folder, or 'shipped') drafting every speculative decode")

    v = sub.add_parser("serve", help="serve an OpenAI-style images API with continuous "
                                     "batching and speculation", formatter_class=HELP)
    add_model_flags(v, SERVE_MODELS)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    v.add_argument("--port", type=int, default=8000, help="port to serve on")
    v.add_argument("--max-batch", type=int, default=8,
                   help="images decoded together per decode setting (1: one at a time)")
    v.add_argument("--max-rows", type=int, default=None,
                   help="sample rows in flight over all settings (an image under guidance is "
                        "two rows; default: twice --max-batch)")
    v.add_argument("--queue", type=int, default=64, help="requests that may wait; more get 503")
    v.add_argument("--api-key", default=None,
                   help="require this key of every call (Authorization: Bearer KEY; or set "
                        "SPECULAAS_API_KEY)")
    v.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS",
                   help="a request still unfinished this long after it arrived gets 503")
    v.add_argument("--warm-up", type=float, default=120.0, metavar="SECONDS",
                   help="at start-up, time the decoding loop for window='auto' for at most "
                        "this long before /health says ok (cached per machine; 0: skip, use "
                        "the reference cost curve)")
    v.add_argument("--drafter", default=None, metavar="DIR",
                   help="a draft head for the model (a folder from train-drafter, or 'shipped' "
                        "for the built-in model's) drafting every speculative request")
    r = v.add_argument_group("Ray Serve (pip install -e \".[ray]\"): replicas of the engine")
    r.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve: one engine per replica, requests routed to the "
                        "shortest queue, replicas restarted when they fail")
    r.add_argument("--address", default=None,
                   help="the Ray cluster to join (default: start a local one)")
    r.add_argument("--replicas", type=int, default=1,
                   help="replicas (with --max-replicas: how many to start with)")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    r.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling upper bound (scaled on requests in flight per replica)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica")
    r.add_argument("--replica-gpus", type=float, default=0.0,
                   help="GPUs per replica (use with --device cuda)")
    v.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection whose request line and headers are not complete "
                        "this long after it opened or after its last response")

    t = sub.add_parser("train-drafter", formatter_class=HELP,
                       help="train a draft head for a model by self-distillation (no data set)",
                       description="The model draws its own images, one teacher-forced pass "
                                   "records its features, and a small head learns to guess its "
                                   "next tokens from them. Resumes where an interrupted run "
                                   "stopped (same --out and options).")
    add_model_flags(t, model_help=f"one of {', '.join(MODEL_NAMES)} (heads run on "
                                  f"{', '.join(DRAFTER_MODELS)})")
    t.add_argument("--out", required=True, help="folder for the head (and its data/, train.pt)")
    t.add_argument("--prompts", default=None,
                   help="prompt file (.txt/.tsv/.csv/COCO .json); default: the built-in "
                        "model's caption grammar, the tiny model's classes")
    t.add_argument("--images", type=int, default=TrainConfig.images,
                   help="target samples to distil from")
    t.add_argument("--batch", type=int, default=TrainConfig.batch,
                   help="images per AR decode while collecting")
    t.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimiser steps")
    t.add_argument("--chains", type=int, default=TrainConfig.chains,
                   help="chains per optimiser step")
    t.add_argument("--lr", type=float, default=TrainConfig.lr,
                   help="peak learning rate (cosine decay)")
    t.add_argument("--unroll", type=int, default=TrainConfig.unroll,
                   help="chain steps trained per chain")
    t.add_argument("--width", type=int, default=TrainConfig.width, help="the head's width")
    t.add_argument("--blocks", type=int, default=TrainConfig.blocks,
                   help="the head's residual MLP blocks")
    t.add_argument("--depth", type=int, default=TrainConfig.depth,
                   help="slots drafted per window by default (--draft-depth at use)")
    t.add_argument("--stale", action="store_true",
                   help="a head whose first step reads the stale feature after a rejection "
                        "(more teacher-forced passes while collecting; docs/architecture.md)")
    t.add_argument("--seed", type=int, default=TrainConfig.seed,
                   help="prompts, samples and minibatches")
    t.add_argument("--prior-prompts", type=int, default=TrainConfig.prior_prompts,
                   help="held-out prompts decoded per window to measure what window=auto "
                        "expects of the head (0: none)")
    t.add_argument("--temperature", type=float, default=None,
                   help="sampling the head serves (None: the model's default)")
    t.add_argument("--top-k", type=int, default=None, help="None: the model's default")
    t.add_argument("--cfg-scale", type=float, default=None, help="None: the model's default")

    sub.add_parser("captions", help="the caption grammar of the built-in model, with examples")
    # The training script parses its own options (`speculaas train --help` lists them), so they
    # reach it as the arguments this parser does not know.
    sub.add_parser("train", help="train the built-in model from scratch (--help: its options)",
                   add_help=False)

    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "captions":
            cmd_captions()
        elif args.command == "train-drafter":
            cmd_train_drafter(args)
        elif args.command == "bench":
            cmd_bench(args)
        elif args.command == "serve" and args.ray:
            cmd_serve_ray(args)
        elif args.command == "serve":
            from speculaas.serve.app import serve
            serve(args.model, args.host, args.port, args.weights, args.max_batch, args.queue,
                  args.time_limit, args.warm_up, args.api_key, args.drafter,
                  args.header_timeout, model_options=_model_options(args),
                  max_rows=args.max_rows)
        elif args.command == "demo":
            from speculaas.demo.app import serve
            serve(args.model, args.host, args.port, args.weights, args.drafter)
        elif args.command == "train":
            from speculaas.models.builtin.train import main as train_main
            train_main(rest)
    except ValueError as e:
        parser.exit(2, f"speculaas: error: {e}\n")
    except OSError as e:  # a read-only folder, a full disk, a path that is a file ...
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        parser.exit(2, f"speculaas: error: {e.strerror or e}{where}\n")
    except KeyboardInterrupt:
        parser.exit(130, "speculaas: interrupted; finished files are complete, none is half "
                         "written\n")


if __name__ == "__main__":
    main()
