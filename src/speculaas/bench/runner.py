"""`speculaas bench`: every method on the same prompts and seeds, side by side, in one run.

Results are appended to DIR/results.rank<R>.jsonl as each (variant, prompt, seed) finishes, so a
killed run resumes where it stopped (`--resume`). Under `torchrun --nproc-per-node N` the work is
sharded across ranks with accelerate (`PartialState(cpu=...)`, `split_between_processes`);
rank 0 gathers every rank's lines and writes the report. Per-item seeds make the tokens
independent of the sharding.
"""

from __future__ import annotations

import json
import resource
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..api import METHODS, generate

RESULTS_GLOB = "results.rank*.jsonl"
# Options a variant may set besides its rule's own: what generate() takes per decode. Others
# (seed, method, model, prompts, decode_images, profile, progress, max_batch) belong to the run.
DECODE_OPTIONS = ("window", "draft_init", "coupling", "advance", "row_context", "verify",
                  "tree", "drafter", "draft_depth", "head_blend", "temperature", "top_k", "top_p",
                  "cfg_scale")


@dataclass(frozen=True)
class Variant:
    """A method with fixed options, e.g. csd with delta=0.35; `label` names it in tables."""

    method: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.method
        return f"{self.method}(" + ",".join(f"{k}={v}" for k, v in self.options.items()) + ")"

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """"csd" or "csd:delta=0.35:lam=0.5"; option names are checked against the method's
        and generate()'s per-decode options, each given once."""
        from .. import acceptance

        name, *pairs = spec.strip().split(":")
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r} in {spec!r}; valid: {METHODS}")
        valid = DECODE_OPTIONS + (tuple(acceptance.options(name)) if name != "ar" else ())
        opts = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"bad option {pair!r} in {spec!r}; use key=value")
            if key in opts:
                raise ValueError(f"option {key!r} given twice in {spec!r}")
            if key not in valid:
                raise ValueError(f"unknown option {key!r} for {name} in {spec!r} (seed, model, "
                                 "prompts and the like are the run's); valid: "
                                 f"{', '.join(valid)}")
            opts[key] = _number(value)
        return cls(name, opts)


def _number(text: str):  # noqa: ANN202
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def expand_sweeps(variants: list[Variant], sweeps: list[str]) -> list[Variant]:
    """--sweep csd.delta=0.35,0.5 adds csd:delta=0.35 and csd:delta=0.5."""
    out = list(variants)
    for sweep in sweeps:
        target, sep, values = sweep.partition("=")
        method, dot, key = target.partition(".")
        if not (sep and dot) or method not in METHODS:
            raise ValueError(f"bad sweep {sweep!r}; use METHOD.OPTION=V1,V2,...")
        out += [Variant(method, {key: _number(v)}) for v in values.split(",")]
    seen, unique = set(), []
    for v in out:
        if v.label not in seen:
            seen.add(v.label)
            unique.append(v)
    return unique


@dataclass
class BenchConfig:
    model: str = "builtin"
    weights: str | None = None
    device: str = "cpu"
    prompts: str = "builtin-set"
    limit: int | None = 32
    seeds: int = 2
    variants: list[Variant] = field(default_factory=lambda: [Variant("ar"), Variant("csd")])
    window: int | str | None = None  # None: auto (16 with row_context)
    out: Path = Path("bench-out")
    resume: bool = False
    maps: int = 3
    warmup: bool = True
    model_options: dict = field(default_factory=dict)  # e.g. dtype, vq=, grid= for adapters
    # {window: seconds} from --cost-curve: window="auto" chooses from it, and the report adds
    # each variant's speed-up modelled on it (decoding.window.load_cost_curve).
    cost_curve: dict | None = None


def _key(variant: str, prompt_index: int, seed: int) -> str:
    return f"{variant}|{prompt_index}|{seed}"


REQUIRED = ("variant", "prompt_index", "seed", "forward_passes", "tokens", "settings")


def read_log(path: Path, repair: bool = False) -> tuple[list[dict], list[str]]:
    """The valid rows of one append-only results log, and a note per line that was not.

    A final line without its newline was cut short by a kill: it is dropped (with `repair`,
    cut off the file, so the next append starts on a fresh line) and its item runs again. A
    bad line anywhere else is reported by line number; the rows around it are kept.
    """
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    notes = []
    if complete < len(data):
        notes.append(f"{path.name}: dropped a torn last line (a kill mid-write); its item "
                     "runs again")
        if repair:
            with path.open("r+b") as f:
                f.truncate(complete)
    rows = []
    for number, line in enumerate(data[:complete].decode(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            notes.append(f"{path.name} line {number}: not JSON; skipped")
            continue
        missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
        if missing:
            notes.append(f"{path.name} line {number}: not a result row (missing "
                         f"{', '.join(missing)}); skipped")
            continue
        rows.append(row)
    return rows, notes


def read_results(out: Path, repair: bool = False) -> list[dict]:
    rows = []
    for path in sorted(out.glob(RESULTS_GLOB)):
        found, notes = read_log(path, repair)
        for note in notes:
            print(f"speculaas bench: {note}")
        rows += found
    return rows


def item_settings(cfg: BenchConfig, model, v: Variant, prompt) -> dict:  # noqa: ANN001
    """Everything that decides an item's result besides its seed; stored in every row, and
    compared on --resume."""
    from .. import __version__
    from ..api import resolve_sampling

    opts = _decode_options(cfg, v)
    sampling = resolve_sampling(model, opts.get("temperature"), opts.get("top_k"),
                                opts.get("top_p"), opts.get("cfg_scale"))
    if "drafter" in opts:  # the head's weights, not only its folder
        opts["drafter"] = f"{opts['drafter']}@{_head(opts['drafter'], model).head_id}"
    return {"model": cfg.model, "weights": cfg.weights,
            "weights_id": getattr(model, "weights_id", None), "method": v.method,
            "options": {k: v for k, v in sorted(opts.items())}, "sampling": vars(sampling),
            "prompt": prompt if isinstance(prompt, (str, int, type(None))) else repr(prompt),
            "model_options": {k: str(x) for k, x in sorted(cfg.model_options.items())},
            # window="auto" chooses from a given curve (_generate_options)
            **({"cost_curve": {str(w): t for w, t in sorted(cfg.cost_curve.items())}}
               if _auto_on_curve(cfg, v, opts) else {}),
            "version": __version__}


def _differences(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decode_options(cfg: BenchConfig, v: Variant) -> dict:
    """A variant's options over the run's defaults: `csd:window=32:coupling=maximal` works."""
    return {"window": cfg.window, **v.options}


def _generate_options(cfg: BenchConfig, v: Variant, model) -> dict:  # noqa: ANN001
    """What generate() gets for a variant: its options, with window="auto" choosing from the
    run's cost curve where one is given (--cost-curve), else from the curve the run starts
    with, never learning during the run (shards and resumed halves choose alike)."""
    opts = _decode_options(cfg, v)
    if _auto_policy(v, opts):
        from ..decoding.window import AutoWindow
        opts["window"] = AutoWindow(cost=cfg.cost_curve, learn=False)
    if "drafter" in opts:  # loaded once per run: a load is not part of any image's latency
        opts["drafter"] = _head(opts["drafter"], model)
    return opts


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {folder: head}


def _head(path, model):  # noqa: ANN001, ANN202
    """The draft head in `path` for `model`, loaded once per model."""
    from ..drafter.head import load_head

    heads = _HEADS.setdefault(model, {})
    if str(path) not in heads:
        heads[str(path)] = load_head(str(path), model)
    return heads[str(path)]


def _auto_policy(v: Variant, opts: dict) -> bool:
    return (opts["window"] in (None, "auto") and opts.get("row_context") is None
            and v.method != "ar")


def _auto_on_curve(cfg: BenchConfig, v: Variant, opts: dict) -> bool:
    return cfg.cost_curve is not None and _auto_policy(v, opts)


def _check_variant(model, cfg: BenchConfig, v: Variant) -> None:  # noqa: ANN001
    """Raise the ValueError generate() would raise for this variant's option values."""
    from ..api import build_rule, resolve_sampling
    from ..config import JacobiConfig

    opts = _decode_options(cfg, v)
    sampling = {k: opts.pop(k) for k in ("temperature", "top_k", "top_p", "cfg_scale")
                if k in opts}
    decoding = {k: opts.pop(k) for k in DECODE_OPTIONS if k in opts}
    try:
        resolve_sampling(model, **sampling)
        build_rule(model, v.method, **opts)
        if v.method != "ar":
            if "drafter" in decoding:
                _head(decoding.pop("drafter"), model)
            jacobi = JacobiConfig(**decoding)
            if jacobi.tree is not None:
                from ..decoding.tree import check_tree
                check_tree(jacobi.tree, model, jacobi.window)
    except ValueError as e:
        raise ValueError(f"variant {v.label}: {e}") from None


def run(cfg: BenchConfig) -> dict | None:
    """Run (or resume) the benchmark; returns the summary on rank 0, None elsewhere."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    try:
        return _run(cfg, state)
    finally:
        # A process that exits with its process group alive can abort in the communication
        # threads' teardown ("terminate called without an active exception").
        if state.num_processes > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _hold_out(out: Path, rank: int):  # noqa: ANN202
    """An exclusive lock on this rank's results in `out`, held for the run: two runs (two
    `--resume`s, say) on one folder would write every item twice. ValueError if another run
    holds it; None where the system has no locks."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(out / f".rank{rank}.lock", "a")  # noqa: SIM115 - held open for the run
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"another bench run is writing to {out}; wait for it to finish, or "
                         "use another --out") from None
    except OSError:  # a file system without locks
        pass
    return f


def _run(cfg: BenchConfig, state) -> dict | None:  # noqa: ANN001
    from tqdm import tqdm

    from .. import load_model
    from .prompts import load_prompts
    from .report import write_report

    say = print if state.is_main_process else (lambda *a, **k: None)
    cfg.out.mkdir(parents=True, exist_ok=True)
    held = _hold_out(cfg.out, state.process_index)  # noqa: F841 - held until the run ends
    device = cfg.device if state.num_processes == 1 or cfg.device == "cpu" else state.device
    prompts = load_prompts(cfg.prompts, cfg.limit, cfg.model)
    n_items = len(prompts) * cfg.seeds * len(cfg.variants)
    say(f"speculaas bench: {len(prompts)} prompts x {cfg.seeds} seeds x {len(cfg.variants)} "
        f"variants = {n_items} images; loading {cfg.model}...", flush=True)
    model = load_model(cfg.model, cfg.weights, device=device, **cfg.model_options)
    # Interleave: every variant runs on a (prompt, seed) before the next pair starts, so machine
    # drift affects all methods alike.
    pairs = [(i, s) for i in range(len(prompts)) for s in range(cfg.seeds)]
    results_path = cfg.out / f"results.rank{state.process_index}.jsonl"
    settings = {(v.label, i): item_settings(cfg, model, v, prompts[i])
                for v in cfg.variants for i in range(len(prompts))}
    done = set()
    if cfg.resume:
        for r in read_results(cfg.out, repair=state.is_main_process):
            want = settings.get((r["variant"], r["prompt_index"]))
            if want is None:
                continue  # a variant or prompt this run does not ask for
            if r["settings"] != want:
                raise ValueError(
                    f"--resume: {cfg.out} holds results of other settings for "
                    f"{r['variant']} prompt {r['prompt_index']}: "
                    + "; ".join(_differences(r["settings"], want))
                    + ". Use a new --out, or the settings of the first run")
            done.add(_key(r["variant"], r["prompt_index"], r["seed"]))
    for v in cfg.variants:  # every variant's values checked before --out is touched
        _check_variant(model, cfg, v)
    if not cfg.resume and state.is_main_process:
        for old in cfg.out.glob(RESULTS_GLOB):
            old.unlink()
    state.wait_for_everyone()

    with state.split_between_processes(pairs) as mine:
        todo = [(v, i, s) for i, s in mine for v in cfg.variants
                if _key(v.label, i, s) not in done]
        if cfg.warmup and todo:
            say(f"warm-up: one unrecorded image per variant ({len(cfg.variants)})...", flush=True)
            t0 = time.perf_counter()
            warm = tqdm(cfg.variants, desc="warm-up", dynamic_ncols=True, leave=False,
                        disable=not state.is_local_main_process)
            for v in warm:  # one unrecorded image per variant: caches, allocator, JIT
                generate(model, [prompts[0]], method=v.method, seed=0, decode_images=False,
                         **_generate_options(cfg, v, model))
            per_image = (time.perf_counter() - t0) / len(cfg.variants)
            say(f"{len(todo)} images to run on this process, about "
                f"{len(todo) * per_image / 60:.1f} min at {per_image:.2f} s per image", flush=True)
        bar = tqdm(todo, desc=f"bench rank {state.process_index}", dynamic_ncols=True,
                   disable=not state.is_local_main_process)
        with results_path.open("a") as f:
            for v, i, s in bar:
                seed = 1000 * i + s  # per (prompt, seed) item: independent of sharding
                out = generate(model, [prompts[i]], method=v.method, seed=seed,
                               decode_images=False, profile=True,
                               **_generate_options(cfg, v, model))
                row = {
                    "variant": v.label, "method": v.method, "options": v.options,
                    "settings": settings[(v.label, i)], "mean_window": float(out.mean_window[0]),
                    "windows": {str(w): n for w, n in out.windows[0].items()},
                    "prompt_index": i, "prompt": prompts[i], "seed": s,
                    "forward_passes": int(out.forward_passes[0]),
                    "tokens": out.tokens[0].tolist(),
                    "commit_step": out.commit_step[0].flatten().tolist(),
                    "drafted": out.drafted[0].flatten().int().tolist(),
                    "entropy": [round(x, 4) for x in out.entropy[0].flatten().tolist()],
                    "accept_hist": out.accept_hist[0].tolist(),
                    "latency_s": out.latency_s, "rule_seconds": out.rule_seconds,
                    "head_seconds": out.head_seconds,
                    "peak_memory_mb": _peak_memory_mb(model.device),
                    "rank": state.process_index, "time": time.time(),
                }
                f.write(json.dumps(row) + "\n")
                f.flush()
    state.wait_for_everyone()
    from accelerate.utils import gather_object

    mine, _ = read_log(results_path)
    rows = gather_object(mine) if state.num_processes > 1 else mine
    if not state.is_main_process:
        return None
    # Only the items this run asks for: a resumed folder may hold more prompts or seeds.
    rows = [r for r in rows if (r["variant"], r["prompt_index"]) in settings
            and r["seed"] < cfg.seeds]
    say("report: decoding images, quality metrics, plots and maps...", flush=True)
    return write_report(cfg, model, prompts, rows)
