"""The window policy: how many slots each image gets in the next forward.

A fixed window is the classic choice, but the right one depends on the hardware: on a 2-core CPU
a 16-slot iteration of the built-in model costs ~2.6 AR steps and a 64-slot one ~6, on a GPU a
7B model's 64-slot forward costs about one step. `AutoWindow` measures the cost curve t(W) of
an iteration (once per machine, model shape, batch size and guidance setting; cached in the
process and on disk) and, every iteration, picks the W that
maximises the batch's expected committed tokens per second, from a measured prior of what each
window commits and each image's running acceptance.

The choice only ever depends on what has already been committed and verified, never on the
drafts it keeps or drops, so every lossless rule stays lossless (tested on the toy model).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import statistics
import time
import weakref
from pathlib import Path

import torch

from ..config import SamplingConfig
from ..io import write_text
from ..models.base import Session
from ..sampling import target_probs

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

# model -> {(batch, cfg): {window: seconds}}; measured once per process.
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cost_cache_file() -> Path | None:
    """Where measured cost curves persist between processes: $SPECULAAS_CACHE_DIR (or
    ~/.cache/speculaas)/cost_curves.json; SPECULAAS_CACHE_DIR=off keeps them in memory only."""
    root = os.environ.get("SPECULAAS_CACHE_DIR")
    if root == "off":
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


def _curve_key(model, batch: int, cfg: bool) -> str:  # noqa: ANN001
    """What the cost of an iteration depends on: the model's shape (name, vocabulary, tokens,
    parameter count and dtype of its modules), the device, the threads, torch, the batch and
    whether guidance doubles the rows."""
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
                       torch.__version__, batch, cfg])


@contextlib.contextmanager
def _disk_cache(model, batch: int, cfg: bool):  # noqa: ANN001, ANN202
    """Yields (stored curve or None, store(curve)). Processes on one machine share the curve, so
    a resumed or distributed bench and repeated CLI calls choose the same windows; a lock makes
    concurrent processes wait for the first one's measurement instead of taking their own."""
    path = cost_cache_file()
    if path is None:
        yield None, lambda curve: None
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115
    except OSError:  # read-only home: measure every process
        yield None, lambda curve: None
        return
    key = _curve_key(model, batch, cfg)
    with lock:
        with contextlib.suppress(ImportError, OSError):
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            table = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            table = {}
        stored = {int(w): float(t) for w, t in table.get(key, {}).items()}

        def store(curve: dict[int, float]) -> None:
            table[key] = {str(w): t for w, t in {**stored, **curve}.items()}
            with contextlib.suppress(OSError):
                write_text(path, json.dumps(table, indent=1))

        yield stored or None, store


def measure_cost_curve(model, session: Session, cfg: bool, windows: tuple[int, ...],  # noqa: ANN001
                       rounds: int = 2) -> dict[int, float]:
    """Median wall time of one iteration at each window size for this batch, in seconds: the
    forward with its target-probability work, and for W > 1 the rest of a Jacobi iteration
    (uniforms, fresh drafts, verification and redrafting, the commit record; sjd with maximal
    coupling on the window's own targets), which is what a speculative iteration costs beyond
    an AR step. Each round times every window four times after one untimed call at that
    window (a decode repeats its window, so caches are warm for it;
    rounds spread drift from a cold start or a busy neighbour over all windows alike), half-way
    through the image (attention over a typical prefix). Runs on the decode's own session:
    what a window writes past a committed prefix never influences later results (the Session
    contract), so the measurement leaves no trace. Cached per model object, batch size and
    guidance setting for the life of the process, and on disk for the machine
    (`cost_cache_file`): the first process measures, later ones reuse its curve."""
    key = (session.batch_size, cfg)
    cached = _COSTS.setdefault(model, {}).get(key)
    if cached is not None and all(w in cached for w in windows):
        return {w: cached[w] for w in windows}
    with _disk_cache(model, session.batch_size, cfg) as (stored, store):
        if stored is not None and all(w in stored for w in windows):
            costs = {w: stored[w] for w in windows}
        else:
            costs = _measure(model, session, cfg, windows, rounds)
            store(costs)
    _COSTS[model][key] = {**(cached or {}), **costs}
    return costs


def _measure(model, session: Session, cfg: bool, windows: tuple[int, ...],  # noqa: ANN001
             rounds: int) -> dict[int, float]:
    dev, batch, length = model.device, session.batch_size, model.layout.length
    images = torch.arange(batch, device=dev)
    start = torch.full((batch,), max(0, min(length // 2, length - max(windows))),
                       dtype=torch.long, device=dev)
    sampling = SamplingConfig(cfg_scale=2.0 if cfg else None)
    times: dict[int, list[float]] = {w: [] for w in windows}
    with torch.inference_mode():
        for _ in range(rounds):
            for w in windows:
                inputs = torch.zeros(batch, w, dtype=torch.long, device=dev)
                for call in range(5):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    cond, uncond = session.forward(inputs, start, images)
                    q = target_probs(cond, uncond, sampling)
                    if w > 1:
                        _iteration_like_a_window(q, inputs, images, start, w, length)
                    else:
                        q.cumsum(-1)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    if call:
                        times[w].append(time.perf_counter() - t0)
    return {w: statistics.median(t) for w, t in times.items()}


def _iteration_like_a_window(q: torch.Tensor, inputs: torch.Tensor, images: torch.Tensor,
                             start: torch.Tensor, w: int, length: int) -> None:
    """The per-iteration work of the Jacobi loop besides the forward, on stand-in drafts: the
    uniforms, fresh drafts (vertical), verification and redrafting (sjd, maximal coupling),
    the commit record and the recycled drafts with their laws."""
    from ..acceptance import get
    from .drafting import FreshSlots, Maximal, VerticalInit
    from .jacobi import verify_window
    from .result import Commits, draw

    b, dev, vocab = len(images), q.device, q.shape[-1]
    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(b)]
    rnd = draw(gens, images, 3 * w + 1, dev)
    k = w - 1
    pos = start[:, None] + torch.arange(w, device=dev)
    record = Commits(b, length + w, dev)
    drafts, laws = inputs[:, 1:], q[:, :-1]
    fresh = torch.ones_like(drafts, dtype=torch.bool)
    init = VerticalInit(vocab, 16, b, dev)
    fd, fdp = init.fill(FreshSlots(images, pos[:, :k], fresh, start, start, drafts, laws,
                                   record.tokens, rnd[:, 2 * w + 1 :][:, :k]))
    laws = torch.where(fresh[..., None], fdp, laws)
    outputs = torch.full((b,), w, device=dev)
    acc, _, _, y, y_dist, _ = verify_window(get("sjd"), Maximal(vocab, gens, dev), images,
                                            torch.where(fresh, fd, drafts), laws, q, pos,
                                            outputs, rnd, w)
    keep = torch.arange(w, device=dev) <= acc[:, None]
    record.write(images, pos, keep, y, 0, keep, q)
    src = (acc[:, None] + 1 + torch.arange(k, device=dev)).clamp(max=w - 1)
    laws[images] = y_dist.gather(1, src[..., None].expand(-1, -1, vocab))


class WindowPolicy:
    """A fixed window: every image gets `window` slots every iteration."""

    def __init__(self, window: int) -> None:
        self.max_window = window

    def begin(self, model, session: Session, cfg: bool, lossless: bool = True) -> None:  # noqa: ANN001
        """Called once per decode; `lossless`: whether the rule is exact (policies with priors
        per kind of rule use it)."""
        batch, device = session.batch_size, model.device
        self.windows_sum = torch.zeros(batch, device=device)
        self.iterations = torch.zeros(batch, device=device)

    def choose(self, act: torch.Tensor) -> torch.Tensor:
        """-> window per active image [b] (long)."""
        return torch.full_like(act, self.max_window)

    def plain_ar(self) -> bool:
        """True when this policy would never speculate: the loop then decodes autoregressively
        (a window of 1 in the Jacobi loop costs the same forward plus its bookkeeping)."""
        return False

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:
        """Told each active image's window, usable outputs and accepted drafts this iteration."""
        self.windows_sum[act] += window.float()
        self.iterations[act] += 1

    def mean_window(self) -> torch.Tensor:
        """[B] mean window each image got."""
        return self.windows_sum / self.iterations.clamp(min=1)


class AutoWindow(WindowPolicy):
    """Compute-aware window: the W that maximises the batch's expected committed tokens per
    second, sum_i E_i(W) / t(W).

    t(W) is the measured cost of one iteration at window W for this batch (forward with its
    target-probability work, verification and redrafting; `measure_cost_curve`). E_i(W) =
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
    batch: the forward is as wide as its widest window anyway.

    If at the prior no window beats a single token per second by `margin`, the decode is plain
    AR (`plain_ar`): a compute-bound batch, or a rule whose acceptance cannot pay for the window
    on this machine. 1.25 because the measured curve still puts a speculative iteration about
    15 % closer to an AR step than the real loop takes on the built-in model on a 2-core CPU
    (2.5 vs 2.9 steps at W = 16: allocation and host-side work the stand-in does not repeat),
    plus 10 % so that speculation that merely breaks even is not chosen.
    The choice depends only on the cost curve and on what was already verified, never on the
    drafts it keeps or drops, so every lossless rule stays lossless (tested on the toy model).
    With the curve fixed (cached per process, or given as `cost`) the same seeds and batch give
    the same images; across machines the measured curve, and so the windows, may differ.
    `prior`: a table {W: tokens per iteration} used whatever the rule; None: PRIOR_TOKENS.
    """

    def __init__(self, max_window: int = 64, candidates: tuple[int, ...] = CANDIDATES,
                 cost: dict[int, float] | None = None, prior: dict[int, float] | None = None,
                 decay: float = 0.97, strength: float = 64.0, stickiness: float = 1.1,
                 margin: float = 1.25) -> None:
        super().__init__(max_window)
        self.candidates = tuple(w for w in candidates if w <= max_window) or (max_window,)
        self.cost, self.prior = cost, None if prior is None else dict(prior)
        self.decay, self.strength, self.stickiness, self.margin = (decay, strength, stickiness,
                                                                    margin)

    def begin(self, model, session: Session, cfg: bool, lossless: bool = True) -> None:  # noqa: ANN001
        super().begin(model, session, cfg)
        batch, device = session.batch_size, model.device
        curve = self.cost if self.cost is not None else measure_cost_curve(
            model, session, cfg, self.candidates)
        prior = self.prior or PRIOR_TOKENS["lossless" if lossless else "relaxed"]
        self.curve = curve
        self.cand = torch.tensor(self.candidates, device=device)
        self.t = torch.tensor([curve[w] for w in self.candidates], device=device,
                              dtype=torch.float32)
        self.e0 = torch.tensor([prior_tokens(prior, w) for w in self.candidates],
                               device=device)
        self.seen = torch.zeros(batch, device=device)  # decayed accepted drafts
        self.expected = torch.zeros(batch, device=device)  # decayed prior expectation
        gain = self._gain(torch.arange(batch, device=device))
        self.current = gain.argmax()  # index into candidates, kept on the device
        self._never = bool(gain.max() <= self.margin * gain[self.cand.argmin()])

    def plain_ar(self) -> bool:
        return self._never

    def content(self, act: torch.Tensor) -> torch.Tensor:
        """[b] accepted drafts relative to the prior's expectation (1: as the prior)."""
        return (self.seen[act] + self.strength) / (self.expected[act] + self.strength)

    def _gain(self, act: torch.Tensor) -> torch.Tensor:
        """[candidates] expected committed tokens per second of the active images together."""
        tokens = 1 + self.content(act)[:, None] * (self.e0 - 1)  # [b, candidates]
        return tokens.sum(0) / self.t

    def choose(self, act: torch.Tensor) -> torch.Tensor:
        gain = self._gain(act)
        best = gain.argmax()
        self.current = torch.where(gain[best] > self.stickiness * gain[self.current], best,
                                   self.current)
        return self.cand[self.current].expand_as(act)

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:
        super().observe(act, window, outputs, accepted)
        # Near the end of an image fewer slots are usable: expect what the largest candidate
        # that fits would commit.
        fits = (self.cand[None] <= outputs[:, None]).sum(1).clamp(min=1) - 1
        self.seen[act] = self.seen[act] * self.decay + accepted.float()
        self.expected[act] = self.expected[act] * self.decay + (self.e0[fits] - 1)


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


def make_policy(window) -> WindowPolicy:  # noqa: ANN001
    """int -> fixed window; "auto" -> AutoWindow(); a WindowPolicy is used as given."""
    if isinstance(window, WindowPolicy):
        return window
    if window == "auto":
        return AutoWindow()
    return WindowPolicy(int(window))
