"""Cost curves t(W): the wall time of one iteration of the decoding loop at each window W.

The window policy (window.py) reads a curve and never asks where it came from. A decode's curve
comes from, in this order:
  - the caller (`AutoWindow(cost=...)`, `--cost-curve FILE`: `load_cost_curve`);
  - this machine, for a decode whose windows cannot change a token (sample-exact verification):
    the curve stored by earlier decodes of the same setting (in the process and on disk), else
    the reference shape, refined online from the loop's own timed iterations (`OnlineCurve`),
    and stored again when the decode ends. Nothing is timed before the first token;
  - the reference curve of the device kind (`REFERENCE_CURVES`), for every other decode: a
    relaxed rule's tokens depend on its windows, so its windows must not depend on how busy the
    machine is (the same seed draws the same picture).
`cost_curve(..., measure)` measures a whole curve up front (the server's warm-up before it
reports healthy, and benchmarks), under a lock per setting, with rounds of re-measuring while
timings disagree; what it stores is what later decodes start from.
"""

from __future__ import annotations

import bisect
import collections
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

# model -> {(batch, cfg, tag): {window: seconds}}; measured once per process. The version tag
# retires curves measured by an older loop (3: Gumbel verification, spread and consistency).
_CURVE_VERSION = 3
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TIMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: windows timed}
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

    def store(self, entry: dict, wait: float = LOCK_WAIT_S) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(self.path.with_suffix(".lock"), wait)
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
                where = disk.where if held else "memory only (the cache cannot be written)"
                entry = _measure(model, batch, windows, entry, measure, where)
                if held:
                    disk.store(entry)
    known = {**entry["t"], **cached}
    _COSTS[model][key] = known
    _TIMED.setdefault(model, {})[key] = set(entry["spread"]) | set(cached)
    return {w: known[w] for w in windows}


def _measure(model, batch: int, windows: tuple[int, ...], entry: dict | None,  # noqa: ANN001
             measure: Callable, where: str) -> dict:
    """Measure what `entry` (a stored curve or None) lacks, or all of it again if provisional;
    each round said on a line of its own, with why it runs and how to skip it."""
    again = entry is not None and not entry["ok"]
    todo = (tuple(sorted(set(windows) | set(entry["t"]))) if again
            else tuple(w for w in windows if entry is None or w not in entry["t"]))
    rounds = 1 + RETRIES

    def say(n: int, why: str) -> None:
        print(f"speculaas: timing one decoding iteration at windows {list(todo)} for "
              f"{model.name}, batch {batch}, round {n} of at most {rounds}: {why} (cached in "
              f"{where}; a fixed window, e.g. --window 16, never times)",
              file=sys.stderr, flush=True)

    say(1, "an earlier measurement was noisy" if again else "first use of this setting")
    t0 = time.monotonic()
    new = summarise(measure(todo))
    for n in range(2, rounds + 1):
        if new["ok"]:
            break
        say(n, f"the last timings were noisy (round {n - 1} took "
               f"{time.monotonic() - t0:.0f} s)")
        t0 = time.monotonic()
        new = _steadier(new, summarise(measure(todo)))
    if entry is None:
        return new
    if again:  # a provisional curve: keep the steadier of the two measurements
        best = _steadier(new, entry)
        return {"t": {**new["t"], **best["t"]}, "spread": {**new["spread"], **best["spread"]},
                "ok": best["ok"], "rounds": entry["rounds"] + 1}
    return {"t": {**entry["t"], **new["t"]}, "spread": {**entry["spread"], **new["spread"]},
            "ok": entry["ok"] and new["ok"], "rounds": entry["rounds"]}


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


# Reference curves in units of one plain AR step (window 0) of the same batch, per device kind
# and batch size (the largest listed batch <= the decode's is used). CPU: the built-in model's
# loop (csd) measured on a quiet 2-core machine (`python benchmarks/reference_curves.py`,
# docs/reference_curves.log). CUDA: a model of a memory-bound forward, where up to 64 slots
# cost about one step and 128 a little more (the CSD paper's 7B models on one GPU).
REFERENCE_CURVES = {
    "cpu": {
        1: {0: 1.0, 1: 1.082, 2: 1.294, 3: 1.276, 4: 1.396, 6: 1.509, 8: 1.629, 12: 1.883, 16:
            2.126, 24: 2.601, 32: 3.088, 48: 4.067, 64: 5.041, 128: 9.136},
        2: {0: 1.0, 1: 1.121, 2: 1.303, 3: 1.364, 4: 1.413, 6: 1.588, 8: 1.763, 12: 2.17, 16:
            2.538, 24: 3.174, 32: 4.197, 48: 5.277, 64: 6.941, 128: 13.704},
        4: {0: 1.0, 1: 1.141, 2: 1.357, 3: 1.517, 4: 1.582, 6: 1.879, 8: 2.137, 12: 2.813, 16:
            3.362, 24: 4.636, 32: 5.944, 48: 8.391, 64: 10.957, 128: 22.815},
        8: {0: 1.0, 1: 1.062, 2: 1.409, 3: 1.775, 4: 1.971, 6: 2.546, 8: 3.015, 12: 3.884, 16:
            4.727, 24: 6.063, 32: 7.868, 48: 11.393, 64: 15.576, 128: 31.982},
    },
    "cuda": {
        1: {0: 1.0, 1: 1.05, 2: 1.05, 4: 1.06, 8: 1.07, 16: 1.09, 32: 1.12, 64: 1.2,
            128: 1.45},
    },
}


def reference_curve(device_type: str, batch: int) -> dict[int, float]:
    """The reference curve (AR steps) of a device kind at a batch size; devices without one of
    their own (mps, xpu, ...) use the CUDA model."""
    table = REFERENCE_CURVES.get(device_type, REFERENCE_CURVES["cuda"])
    sizes = sorted(table)
    return dict(table[sizes[max(0, bisect.bisect_right(sizes, batch) - 1)]])


def curve_at(curve: dict[int, float], window: int) -> float:
    """t(window) from a curve: listed, linear between listed windows, and linear beyond the last
    two (flat below the first)."""
    if window in curve:
        return curve[window]
    ws = sorted(curve)
    if window < ws[0] or len(ws) == 1:
        return curve[ws[0]]
    lo, hi = (ws[-2], ws[-1]) if window > ws[-1] else next(
        (a, b) for a, b in itertools.pairwise(ws) if a < window < b)
    return max(curve[lo] + (curve[hi] - curve[lo]) * (window - lo) / (hi - lo), 1e-12)


class OnlineCurve:
    """t(W) of one decode, refined from its own timed iterations.

    `start` is where it begins (a stored curve in seconds, or a reference in AR steps); the
    windows in `timed` were timed on this machine before and count as `min_samples` timings of
    their start value. A window with `min_samples` timings gets the median of its last `keep`
    ones (a median, so one iteration slowed by a neighbour's burst moves nothing; new timings
    push the old out); every other window gets its start value scaled by the median ratio
    timed / start over the windows timed so far, so the shape of the start curve carries the
    scale of this machine to windows not yet tried."""

    def __init__(self, start: dict[int, float], timed=(), keep: int = 9,  # noqa: ANN001
                 min_samples: int = 3) -> None:
        self.start, self.keep, self.min_samples = dict(start), keep, min_samples
        self.samples: dict[int, collections.deque] = {
            w: collections.deque([start[w]] * min_samples, maxlen=keep)
            for w in timed if w in start}
        self.fresh = False  # timed anything itself

    def add(self, window: int, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            self.fresh = True
            self.samples.setdefault(int(window), collections.deque(maxlen=self.keep)).append(
                seconds)

    def known(self, window: int) -> bool:
        return len(self.samples.get(window, ())) >= self.min_samples

    def timed(self) -> dict[int, float]:
        """{window: median seconds} of the windows with enough timings."""
        return {w: statistics.median(s) for w, s in self.samples.items() if self.known(w)}

    def curve(self, windows) -> dict[int, float]:  # noqa: ANN001
        timed = self.timed()
        ratios = [t / curve_at(self.start, w) for w, t in timed.items()]
        scale = statistics.median(ratios) if ratios else 1.0
        return {w: timed.get(w, scale * curve_at(self.start, w)) for w in windows}


class CurveSource:
    """A decode's cost curve: what its policy starts from (this machine's stored curve where
    `machine`, else the reference) and, where `learn` (the windows cannot change a token), an
    OnlineCurve it refines and `save()` stores for the next decode of the setting (in the
    process, and on disk without waiting for a lock held elsewhere)."""

    def __init__(self, model, batch: int, cfg: bool, tag: str, learn: bool,  # noqa: ANN001
                 machine: bool | None = None) -> None:
        self.model, self.batch, self.cfg, self.tag, self.learn = model, batch, cfg, tag, learn
        self.machine = learn if machine is None else machine  # may this machine's curve decide?
        self.online: OnlineCurve | None = None
        self._disk: _DiskCache | None = None

    @property
    def disk(self) -> _DiskCache:
        """The setting's place in the cache file (its key, from the model's parameters, is
        worked out once per decode)."""
        if self._disk is None:
            self._disk = _DiskCache(self.model, self.batch, self.cfg, self.tag)
        return self._disk

    def stored(self) -> tuple[dict[int, float], set[int]] | None:
        """This machine's curve of the setting (in the process, else on disk) and the windows
        in it that were timed; None if none."""
        key = (self.batch, self.cfg, self.tag)
        known = _COSTS.get(self.model, {}).get(key)
        if known:
            return dict(known), set(_TIMED.get(self.model, {}).get(key, known))
        entry = self.disk.read()
        return None if entry is None else (dict(entry["t"]), set(entry["spread"]))

    def open(self) -> OnlineCurve:
        """The curve a policy starts from (learned from only where `learn`); opened once per
        decode, later calls return the same."""
        if self.online is not None:
            return self.online
        stored = self.stored() if self.machine else None
        if stored is None:
            stored = reference_curve(self.model.device.type, self.batch), set()
        self.online = OnlineCurve(*stored)
        return self.online

    def save(self, windows) -> None:  # noqa: ANN001
        """Store what this decode learned (windows: those to store, timed or estimated)."""
        if not self.learn or self.online is None or not self.online.fresh:
            return
        curve, key = self.online.curve(windows), (self.batch, self.cfg, self.tag)
        timed = {w: list(s) for w, s in self.online.samples.items()
                 if w in curve and self.online.known(w)}
        _COSTS.setdefault(self.model, {})[key] = curve
        _TIMED.setdefault(self.model, {})[key] = set(timed)
        if self.disk.path is not None:
            spread = summarise(timed)["spread"]  # timed windows only: what later decodes trust
            self.disk.store({"t": curve, "spread": spread, "ok": consistent(curve, spread),
                        "rounds": 1}, wait=0.5)
