"""The window policy: how many slots each image gets in the next forward.

A fixed window is the classic choice, but the right one depends on the hardware: on a 2-core CPU
a 16-slot iteration of the built-in model costs ~2.6 AR steps and a 64-slot one ~6, on a GPU a
7B model's 64-slot forward costs about one step. `AutoWindow` uses the cost curve t(W) of an
iteration (the loop times its own step(), once per machine, model shape, batch size, guidance
setting, rule and drafter; cached in the process and on disk) and, every iteration, picks the W that
maximises the batch's expected committed tokens per second, from a measured prior of what each
window commits and each image's running acceptance.

The choice only ever depends on what has already been committed and verified, never on the
drafts it keeps or drops, so every lossless rule stays lossless (tested on the toy model).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from ..io import write_text
from ..models.base import Session

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Prior committed tokens per iteration E(W) of a decode that keeps the window W: the step
# compression of sjd (lossless rules) and csd at delta 0.65 (relaxed rules), default drafting,
# on 16 built-in captions no benchmark uses x 2 seeds (`python benchmarks/window_prior.py`,
# docs/window_prior.log).
PRIOR_TOKENS = {
    "lossless": {1: 1.0, 2: 1.3, 3: 1.51, 4: 1.69, 6: 1.97, 8: 2.2, 12: 2.57, 16: 2.83,
                 24: 3.1, 32: 3.35, 48: 3.46, 64: 3.59},
    "relaxed": {1: 1.0, 2: 1.36, 3: 1.66, 4: 1.89, 6: 2.32, 8: 2.64, 12: 3.13, 16: 3.57,
                24: 3.94, 32: 4.4, 48: 4.44, 64: 4.56},
}

# model -> {(batch, cfg, tag): {window: seconds}}; measured once per process. The version tag
# retires curves measured by an older loop (3: Gumbel verification, spread and consistency).
_CURVE_VERSION = 3
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# A measured curve is trusted when every window's timed steps agree (interquartile range within
# MAX_SPREAD of the median) and no wider window looks cheaper than MAX_DROP times a narrower
# one; else it is measured again, up to RETRIES more times in the process, and a curve that
# never passes is stored as provisional: later processes measure it again (at most ROUNDS
# times in all) and keep the steadier measurement.
MAX_SPREAD = 0.5
MAX_DROP = 0.9
RETRIES = 2
ROUNDS = 3
_warned: set[str] = set()


def cost_cache_file() -> Path | None:
    """Where measured cost curves persist between processes: $SPECULAAS_CACHE_DIR (or
    ~/.cache/speculaas)/cost_curves.json; SPECULAAS_CACHE_DIR=off (or none, 0, false, no)
    keeps them in memory only."""
    root = os.environ.get("SPECULAAS_CACHE_DIR")
    if root is not None and root.strip().lower() in ("off", "none", "0", "false", "no"):
        return None
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME",
                                                       Path.home() / ".cache")) / "speculaas"
    return base / "cost_curves.json"


def _machine() -> str:
    if platform.system() == "Linux":
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _curve_key(model, batch: int, cfg: bool, tag: str) -> str:  # noqa: ANN001
    """What the cost of an iteration depends on: the model's shape (name, vocabulary, tokens,
    parameter count and dtype of its modules), the device, the threads, torch, the batch,
    whether guidance doubles the rows, and the loop's configuration `tag` (rule, drafter,
    verification, top-k / top-p work, prompt length bucket)."""
    params, dtypes = 0, set()
    for value in vars(model).values():
        if isinstance(value, torch.nn.Module):
            for t in value.parameters():
                params += t.numel()
                dtypes.add(str(t.dtype))
    dev = model.device
    device = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else _machine())
    return json.dumps([model.name, model.vocab_size, model.layout.length, params,
                       sorted(dtypes), dev.type, device, torch.get_num_threads(),
                       torch.__version__, batch, cfg, tag, _CURVE_VERSION])


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"ignoring {why} in the cost-curve cache {path}; measuring again",
                      stacklevel=3)


def _valid_times(times: object) -> dict[int, float] | None:
    """{window: seconds} with every window an integer >= 0 and every time finite and > 0."""
    if not isinstance(times, dict) or not times:
        return None
    out = {}
    for w, t in times.items():
        try:
            w_i, t_f = int(w), float(t)
        except (TypeError, ValueError):
            return None
        if w_i < 0 or not math.isfinite(t_f) or t_f <= 0:
            return None
        out[w_i] = t_f
    return out


def _entry(raw: object) -> dict | None:
    """A stored curve {"t": times, "spread": {window: relative IQR}, "ok": bool, "rounds": n},
    checked; None where any part is malformed."""
    if not isinstance(raw, dict):
        return None
    times, spread = _valid_times(raw.get("t")), raw.get("spread", {})
    if times is None or not isinstance(raw.get("ok"), bool) or not isinstance(spread, dict):
        return None
    try:
        spread = {int(w): float(v) for w, v in spread.items()}
        rounds = int(raw.get("rounds", 1))
    except (TypeError, ValueError):
        return None
    return {"t": times, "spread": spread, "ok": raw["ok"], "rounds": rounds}


def summarise(samples: dict[int, list[float]]) -> dict:
    """Timed samples {window: [seconds]} -> a curve entry: medians, relative interquartile
    ranges, whether the curve is consistent (module constants), one round."""
    times, spread = {}, {}
    for w, ts in samples.items():
        ts = sorted(ts)
        med = statistics.median(ts)
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [med, med, med]
        times[w], spread[w] = med, (q[2] - q[0]) / med if med > 0 else math.inf
    return {"t": times, "spread": spread, "ok": consistent(times, spread), "rounds": 1}


def consistent(times: dict[int, float], spread: dict[int, float]) -> bool:
    """Every time finite and positive, every spread within MAX_SPREAD, and no wider window
    cheaper than MAX_DROP times the next narrower one (window 0, an AR step, is not compared)."""
    if _valid_times(times) is None or any(not s <= MAX_SPREAD for s in spread.values()):
        return False
    ws = sorted(w for w in times if w > 0)
    return all(times[b] >= MAX_DROP * times[a] for a, b in itertools.pairwise(ws))


def _steadier(a: dict, b: dict) -> dict:
    """The better of two measurements of the same windows: a consistent one, else the one whose
    worst window spreads less."""
    def worst(e: dict) -> float:
        return max(e["spread"].values(), default=math.inf)
    if a["ok"] != b["ok"]:
        return a if a["ok"] else b
    return a if worst(a) <= worst(b) else b


def _key_version(key: str) -> object:
    try:
        return json.loads(key)[-1]
    except (ValueError, TypeError, IndexError, KeyError):
        return None


LOCK_WAIT_S = 30.0  # longest wait for another process's measurement (a stopped one never ends)


def _lock(path: Path, wait: float):  # noqa: ANN202
    """An exclusive lock on `path`, opened without following a symlink, waiting at most `wait`
    seconds: the open file, or None where it cannot be had (read-only folder, a symlink, held
    for longer). Systems without flock get the file unlocked."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError:
        return None
    f = os.fdopen(fd, "a")
    try:
        import fcntl
    except ImportError:
        return f
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                return None
            time.sleep(0.05)
        except OSError:  # a file system without locks
            return f


def _read_table(path: Path) -> dict:
    """The cache file's table; {} with one warning when it is unreadable or of the wrong shape."""
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        _warn_once(path, "an unreadable file")
        return {}
    if not isinstance(table, dict):
        _warn_once(path, f"a {type(table).__name__} where a table of curves belongs")
        return {}
    return table


class _DiskCache:
    """One curve's place in the cache file. Reading takes no lock; measuring takes a lock of its
    own key (so a process stopped while measuring blocks nobody measuring something else, and
    the same key at most LOCK_WAIT_S); writing takes the file's lock for the moment it
    rewrites the file, and clears temporary files a killed writer left."""

    def __init__(self, model, batch: int, cfg: bool, tag: str) -> None:  # noqa: ANN001
        self.path = cost_cache_file()
        self.key = _curve_key(model, batch, cfg, tag)

    @property
    def where(self) -> str:
        return "memory only" if self.path is None else str(self.path)

    def read(self) -> dict | None:
        if self.path is None:
            return None
        table = _read_table(self.path)
        if self.key not in table:
            return None
        entry = _entry(table[self.key])
        if entry is None:
            _warn_once(self.path, "a malformed curve")
        return entry

    @contextlib.contextmanager
    def measuring(self):  # noqa: ANN202
        """Holds the key's lock (if it can be had) while the caller measures; yields whether it
        is held (else the caller measures for this process only)."""
        if self.path is None:
            yield False
            return
        digest = hashlib.sha1(self.key.encode()).hexdigest()[:16]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            yield False
            return
        lock = _lock(self.path.with_name(f"{self.path.stem}.{digest}.lock"), LOCK_WAIT_S)
        if lock is None:
            print(f"speculaas: could not lock the cost-curve cache {self.path} (another process "
                  f"has measured this setting for over {LOCK_WAIT_S:.0f} s, or the folder is "
                  "read-only); measuring for this process only", file=sys.stderr, flush=True)
            yield False
            return
        with lock:
            yield True

    def store(self, entry: dict) -> None:
        lock = _lock(self.path.with_suffix(".lock"), LOCK_WAIT_S)
        if lock is None:
            return
        with lock:
            table = _read_table(self.path)
            current = {k: v for k, v in table.items()
                       if _key_version(k) == _CURVE_VERSION and k != self.key}  # old loops go
            current[self.key] = {"t": {str(w): t for w, t in entry["t"].items()},
                                 "spread": {str(w): v for w, v in entry["spread"].items()},
                                 "ok": entry["ok"], "rounds": entry["rounds"]}
            for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
                with contextlib.suppress(OSError):
                    stale.unlink()  # only a writer holding this lock makes them
            with contextlib.suppress(OSError):
                write_text(self.path, json.dumps(current, indent=1))


def cost_curve(model, batch: int, cfg: bool, tag: str, windows: tuple[int, ...],  # noqa: ANN001
               measure: Callable[[tuple[int, ...]], dict[int, list[float]]]) -> dict[int, float]:
    """The cost curve {window: seconds per iteration} of this model, batch, guidance setting
    and loop configuration `tag`, from `measure(windows)` -> {window: [timed seconds]} (the
    loop's own step(), decoding/loop.py): once per model object for the life of the process,
    and once per machine on disk (`cost_cache_file`), where a provisional (inconsistent) curve
    is measured again by later processes. Windows missing from a stored curve are measured and
    merged into it. Says on stderr when it measures. Window 0 is a step of plain AR decoding."""
    key = (batch, cfg, tag)
    cached = _COSTS.setdefault(model, {}).get(key, {})
    if all(w in cached for w in windows):
        return {w: cached[w] for w in windows}
    disk = _DiskCache(model, batch, cfg, tag)

    def settled(e: dict | None) -> bool:
        return e is not None and all(w in e["t"] for w in windows) and (
            e["ok"] or e["rounds"] >= ROUNDS)

    entry = disk.read()  # no lock: a stored curve is used as it is
    if not settled(entry):
        with disk.measuring() as held:
            if held:
                entry = disk.read()  # what the process we waited for stored
            if not settled(entry):
                entry = _measure(model, batch, windows, entry, measure, disk.where)
                if held:
                    disk.store(entry)
    known = {**entry["t"], **cached}
    _COSTS[model][key] = known
    return {w: known[w] for w in windows}


def _measure(model, batch: int, windows: tuple[int, ...], entry: dict | None,  # noqa: ANN001
             measure: Callable, where: str) -> dict:
    """Measure what `entry` (a stored curve or None) lacks, or all of it again if provisional."""
    again = entry is not None and not entry["ok"]
    todo = (tuple(sorted(set(windows) | set(entry["t"]))) if again
            else tuple(w for w in windows if entry is None or w not in entry["t"]))
    print(f"speculaas: timing one decoding iteration at windows {list(todo)} for {model.name}, "
          f"batch {batch} (once per machine and setting; cached in {where})",
          file=sys.stderr, flush=True)
    new = summarise(measure(todo))
    for _ in range(RETRIES):
        if new["ok"]:
            break
        new = _steadier(new, summarise(measure(todo)))
    if entry is None:
        return new
    if again:  # a provisional curve: keep the steadier of the two measurements
        best = _steadier(new, entry)
        return {"t": {**new["t"], **best["t"]}, "spread": {**new["spread"], **best["spread"]},
                "ok": best["ok"], "rounds": entry["rounds"] + 1}
    return {"t": {**entry["t"], **new["t"]}, "spread": {**entry["spread"], **new["spread"]},
            "ok": entry["ok"] and new["ok"], "rounds": entry["rounds"]}


class WindowPolicy:
    """A fixed window: every image gets `window` slots every iteration."""

    def __init__(self, window: int) -> None:
        self.max_window = window

    def begin(self, model, session: Session, cfg: bool, lossless: bool = True,  # noqa: ANN001
              measure: Callable | None = None) -> None:  # noqa: B027 - optional hook
        """Called once per decode; `lossless`: whether the rule is exact (policies with priors
        per kind of rule use it); measure(windows): the loop's cost curve (loop.py)."""

    def choose(self, active: torch.Tensor) -> torch.Tensor:
        """active [B] bool: unfinished images -> the batch's window (a 0-d long tensor on the
        device: the loop reads it with everything else in its one synchronisation)."""
        return torch.tensor(self.max_window, device=active.device)

    def plain_ar(self) -> bool:
        """True when this policy would never speculate: the loop then decodes autoregressively
        (a window of 1 in the Jacobi loop costs the same forward plus its bookkeeping)."""
        return False

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Told each active image's window, usable outputs and accepted drafts this iteration."""


class AutoWindow(WindowPolicy):
    """Compute-aware window: the W that maximises the batch's expected committed tokens per
    second, sum_i E_i(W) / t(W).

    t(W) is the measured cost of one iteration of the loop at window W for this batch (its own
    step(), timed: `loop.measure_cost_curve`). E_i(W) =
    1 + r_i (E(W) - 1): E(W) is the prior tokens per iteration of a decode that keeps window W
    (`PRIOR_TOKENS` for lossless or relaxed rules, interpolated between the windows listed and
    flat after the last), r_i how image i's accepted drafts compare with what the prior expects
    at the windows it got: a ratio of sums decayed by `decay` per iteration and shrunk towards 1
    by `strength` pseudo-iterations. The batch keeps its window until another one promises
    `stickiness` times its rate. A run of rejections (r < 1) shortens the window, down to
    W = 1; a single-token iteration verifies nothing, so r decays back towards 1 and the long
    window returns.

    Why a prior measured at fixed windows and not per-slot acceptance measured online: a draft
    is refined once per iteration it spends in the window before it is verified, so what a
    short window observes is far below what the same slot reaches in a long one (sjd: 1.13
    tokens per iteration for a policy hovering around W = 2, 2.83 at a fixed 16), and a policy
    that trusts its short-window statistics talks itself into short windows. Quick reactions
    do not pay either: acceptance comes in bursts (a whole row of sky, then a rejection at the
    first draft), so the evidence is weighted over tens of iterations. One W for the whole
    batch: the forward is as wide as its widest window anyway. A batch takes as many iterations
    as its slowest image, so the batch's rate is divided by 1 + spread sqrt(W) z_b (z_b: the
    expected maximum of b standard normals; spread 0.035: on the built-in model the forward
    counts of csd and sjd vary across captions with a coefficient of variation of 0.07 at W = 4
    and 0.14-0.16 at W = 16, and a batch of 8 took 1.07-1.33 times its mean image's iterations).

    If at the prior no window beats plain AR decoding (the curve's window 0, a measured AR step;
    else its window 1) by `margin` in tokens per second, the decode is plain AR (`plain_ar`): a
    compute-bound batch, or a rule whose acceptance cannot pay for the window on this machine.
    The curve times the loop's real step(), so the margin is only a guard against speculation
    that merely breaks even (5 %: repeated curves on a 2-core CPU agree to about that in their
    ratios to the AR step), not a correction of the measurement.
    The choice depends only on the cost curve and on what was already verified, never on the
    drafts it keeps or drops, so every lossless rule stays lossless (tested on the toy model).
    With the curve fixed (cached per process, or given as `cost`) the same seeds and batch give
    the same images; across machines the measured curve, and so the windows, may differ.
    `prior`: a table {W: tokens per iteration} used whatever the rule; None: PRIOR_TOKENS.
    """

    def __init__(self, max_window: int = 64, candidates: tuple[int, ...] = CANDIDATES,
                 cost: dict[int, float] | None = None, prior: dict[int, float] | None = None,
                 decay: float = 0.97, strength: float = 64.0, stickiness: float = 1.1,
                 margin: float = 1.05, spread: float = 0.035) -> None:
        super().__init__(max_window)
        self.candidates = tuple(w for w in candidates if w <= max_window) or (max_window,)
        self.cost, self.prior = cost, None if prior is None else dict(prior)
        self.decay, self.strength, self.stickiness, self.margin = (decay, strength, stickiness,
                                                                    margin)
        self.spread = spread

    def begin(self, model, session: Session, cfg: bool, lossless: bool = True,  # noqa: ANN001
              measure: Callable | None = None) -> None:
        batch, device = session.batch_size, model.device
        if self.cost is None and measure is None:
            raise ValueError("AutoWindow needs a cost curve: give `cost`, or let the decoding "
                             "loop measure one")
        if self.cost is not None:  # a given curve: choose among the windows it lists
            listed = tuple(w for w in self.candidates if w in self.cost)
            if not listed:
                raise ValueError(f"the cost curve lists none of the windows {self.candidates}")
            self.candidates = listed
        curve = self.cost if self.cost is not None else measure((0, *self.candidates))
        prior = self.prior or PRIOR_TOKENS["lossless" if lossless else "relaxed"]
        self.curve = curve
        self.cand = torch.tensor(self.candidates, device=device)
        self.t = torch.tensor([curve[w] for w in self.candidates], device=device,
                              dtype=torch.float32)
        self.e0 = torch.tensor([prior_tokens(prior, w) for w in self.candidates],
                               device=device)
        self.straggle = straggler_factor(self.cand, batch, self.spread)
        self.seen = torch.zeros(batch, device=device)  # decayed accepted drafts
        self.expected = torch.zeros(batch, device=device)  # decayed prior expectation
        gain = self._gain(torch.ones(batch, dtype=torch.bool, device=device))
        self.current = gain.argmax()  # index into candidates, kept on the device
        plain = batch / curve[0] if 0 in curve else gain[self.cand.argmin()]
        self._never = bool(gain.max() <= self.margin * plain)

    def plain_ar(self) -> bool:
        return self._never

    def content(self, act: torch.Tensor) -> torch.Tensor:
        """[b] accepted drafts relative to the prior's expectation (1: as the prior); act:
        image indices or a [B] mask."""
        return (self.seen[act] + self.strength) / (self.expected[act] + self.strength)

    def _gain(self, active: torch.Tensor) -> torch.Tensor:
        """[candidates] expected committed tokens per second of the active images ([B] mask)."""
        tokens = 1 + self.content(slice(None))[:, None] * (self.e0 - 1)  # [B, candidates]
        return (tokens * active[:, None]).sum(0) / self.t / self.straggle[active.sum()]

    def choose(self, active: torch.Tensor) -> torch.Tensor:
        gain = self._gain(active)
        best = gain.argmax()
        self.current = torch.where(gain[best] > self.stickiness * gain[self.current], best,
                                   self.current)
        return self.cand[self.current]

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:
        # Near the end of an image fewer slots are usable: expect what the largest candidate
        # that fits would commit.
        fits = (self.cand[None] <= outputs[:, None]).sum(1).clamp(min=1) - 1
        self.seen[act] = self.seen[act] * self.decay + accepted.float()
        self.expected[act] = self.expected[act] * self.decay + (self.e0[fits] - 1)


def straggler_factor(windows: torch.Tensor, batch: int, spread: float) -> torch.Tensor:
    """[batch + 1, len(windows)]: how much longer than its mean image a batch of b images takes
    at each window. A batch takes as many iterations as its slowest image; an image's forward
    count varies across captions with a coefficient of variation of about spread * sqrt(W), and
    the slowest of b images lies z_b standard deviations above the mean."""
    z = _expected_max(batch, windows.device)
    return 1 + spread * windows.float().sqrt()[None] * z[:, None]


def _expected_max(batch: int, device: torch.device) -> torch.Tensor:
    """[batch + 1]: the expected maximum of b independent standard normals, b = 0 .. batch
    (0 for b <= 1), by integrating x d(Phi(x)^b) on a grid."""
    x = torch.linspace(-8.0, 8.0, 4001, dtype=torch.float64)
    cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
    b = torch.arange(batch + 1, dtype=torch.float64)[:, None]
    z = (x[None, 1:] * (cdf[None, 1:] ** b - cdf[None, :-1] ** b)).sum(1)
    z[:2] = 0.0
    return z.float().to(device)


def prior_tokens(prior: dict[int, float], window: int) -> float:
    """E(window) from a table {W: tokens per iteration}: linear between listed windows, flat
    after the last (a window longer than any measured one is assumed to gain nothing more)."""
    ws = sorted(prior)
    if window <= ws[0]:
        return prior[ws[0]]
    for lo, hi in itertools.pairwise(ws):
        if window <= hi:
            return prior[lo] + (prior[hi] - prior[lo]) * (window - lo) / (hi - lo)
    return prior[ws[-1]]


def load_cost_curve(path: str | Path) -> dict[int, float]:
    """A cost curve from a JSON file {"window": seconds, ...} (window 0: one AR step), e.g. a
    GPU's, measured by benchmarks/gpu_latency.py, or a model of one ({"0": 1, "1": 1, ...,
    "128": 1}: a forward of up to 128 slots costs one AR step)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"cost curve file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cost curve file {path} is not readable JSON ({e})") from None
    times = _valid_times(raw)
    if times is None:
        raise ValueError(f"cost curve file {path} must map windows (integers >= 0) to positive "
                         'finite seconds, e.g. {"0": 0.01, "16": 0.011}')
    if not ({1, 0} & set(times)):
        raise ValueError(f"cost curve file {path} needs window 0 (an AR step) or 1")
    return times


def modelled_seconds(curve: dict[int, float], windows: dict[int, int]) -> float:
    """What a decode that ran `windows` ({window: forwards}) would take on `curve` (a window
    not listed costs the next wider one's time, or the widest's)."""
    listed = sorted(curve)
    total = 0.0
    for w, n in windows.items():
        w = int(w)
        at = next((v for v in listed if v >= w), listed[-1])
        total += n * curve[at]
    return total


def make_policy(window) -> WindowPolicy:  # noqa: ANN001
    """int -> fixed window; "auto" -> AutoWindow(); a WindowPolicy is used as given."""
    if isinstance(window, WindowPolicy):
        return window
    if window == "auto":
        return AutoWindow()
    return WindowPolicy(int(window))
