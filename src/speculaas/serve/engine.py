"""Continuous batching with speculation: requests join the running batch between iterations.

The engine keeps one *lane* per decode setting (method, rule options, window, sampling), each a
decoding loop (decoding/loop.py) over a session of `max_batch` rows. A request waits in a
bounded queue until a row of its lane is free; the row is then prefilled with its prompt
(`ImageModel.admit`) and its state restarted with the request's own random stream
(`DecodeState.restart`: the noise key is drawn first, exactly as a decode of its own would), and
from the next iteration on it advances with the others, by its own accepted length. A finished
or cancelled request leaves its row at once; the row is free for the next one.

What a request draws does not depend on who else is in the batch where the rule is
sample-exact (sjd under Gumbel verification: AR's tokens for its seed, whatever the windows) or
the window is fixed (every image's uniforms come from its own stream, one block per iteration).
Under window="auto" the lane picks the window every iteration for the batch it has
(`BatchWindow`: the measured cost curve at that batch size and the prior of what each window
commits; plain one-token steps where no window pays), so a relaxed rule's sample may then depend
on the batch, as it does across machines.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
from PIL import Image

from ..api import build_rule, resolve_sampling
from ..config import DEFAULT_COUPLING, DEFAULT_DRAFT_INIT, JacobiConfig
from ..decoding.costs import CurveSource
from ..decoding.frontier import Raster
from ..decoding.loop import Loop, curve_tag, measure_cost_curve
from ..decoding.window import (
    CANDIDATES,
    PRIOR_TOKENS,
    WindowPolicy,
    prior_tokens,
    straggler_factor,
)
from ..models.base import ImageModel


def _settle(future: Future, result: object = None, error: Exception | None = None) -> None:
    """Give a request's future its outcome, unless it was cancelled from outside (a client's
    `wait_for` timeout, say): then there is nobody to tell, and nothing may fail."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


LOG = logging.getLogger("speculaas.serve")


class QueueFull(RuntimeError):
    """The engine's queue holds `queue_size` waiting requests already."""


class ShuttingDown(QueueFull):
    """The engine is draining before it stops: it takes no new requests."""


class Cancelled(RuntimeError):
    """The request was cancelled (its client left, or its time ran out) before it finished."""


@dataclass
class Request:
    """One image to generate. `options`: the rule's options (lam, delta, ...)."""

    prompt: object
    seed: int = 0
    method: str = "sjd"
    window: int | str = "auto"
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cfg_scale: float | None = None
    options: dict = field(default_factory=dict)
    coupling: str = DEFAULT_COUPLING
    draft_init: str = DEFAULT_DRAFT_INIT
    deadline: float | None = None  # time.monotonic() after which it is cancelled
    partial_images: int = 0  # previews to send while it decodes (at even shares of its tokens)
    on_partial: Callable[[Request, int, Image.Image], None] | None = None  # engine thread
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    batch_sum: int = 0  # images in the batch, summed over the iterations it took part in
    iterations: int = 0
    first_iteration: int = 0
    warmup_s: float = 0.0  # of queue_s: waiting while the server measured its cost curves
    cancelled: threading.Event = field(default_factory=threading.Event)
    partials_sent: int = 0

    def lane_key(self) -> tuple:
        return (self.method, tuple(sorted(self.options.items())), self.window,
                self.temperature, self.top_k, self.top_p, self.cfg_scale, self.coupling,
                self.draft_init)

    def cancel(self) -> None:
        """Leave the batch (or the queue) within one iteration."""
        self.cancelled.set()


@dataclass
class Completion:
    """A finished request: its tokens and image, and how it was decoded (commit_step: the
    iteration of its own decode that committed each token, [rows, cols]; entropy: the target
    entropy there)."""

    tokens: torch.Tensor
    image: Image.Image | None
    forward_passes: int
    windows: dict[int, int]
    queue_s: float
    decode_s: float
    mean_batch: float
    warmup_s: float = 0.0
    commit_step: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class BatchWindow(WindowPolicy):
    """window="auto" for a batch whose size changes every iteration: for each batch size b, the
    window W maximising b E(W) / t_b(W) (E: the prior tokens per iteration, PRIOR_TOKENS; t_b:
    the cost curve at b images, for batch sizes at powers of two, each used for the sizes up to
    the next: this machine's stored curve (the server measures its default setting's before it
    reports healthy, `Engine.warm_up`), else the device kind's reference; a batch of b takes
    its slowest image's iterations, as in AutoWindow), or W = 1 (a one-token step) where no
    window beats plain AR by `margin`. Never times anything itself, so no request waits."""

    def __init__(self, model: ImageModel, rule, sampling, jacobi: JacobiConfig,  # noqa: ANN001
                 capacity: int, tag: str, margin: float = 1.05, spread: float = 0.035,
                 prior: dict[int, float] | None = None) -> None:
        super().__init__(max(CANDIDATES))
        self.model, self.sampling, self.tag, self.margin = model, sampling, tag, margin
        self.prior = prior or PRIOR_TOKENS["lossless" if rule.exact else "relaxed"]
        self.windows = torch.tensor(CANDIDATES)
        self.straggle = straggler_factor(self.windows, capacity, spread)
        self.e0 = torch.tensor([prior_tokens(self.prior, w) for w in CANDIDATES])
        self.buckets = batch_buckets(capacity)
        self.table = [1] * (capacity + 1)  # window per batch size 0 .. capacity
        self.known: set[int] = set()
        self._table: torch.Tensor | None = None

    def ensure(self, batch: int) -> None:
        """Read the curve that batch size `batch` needs, if not yet (no timing)."""
        at = next(s for s in self.buckets if s >= batch)
        if at in self.known:
            return
        source = CurveSource(self.model, at, self.sampling.uses_cfg, self.tag, learn=False,
                             machine=True)
        t = source.open().curve((0, *CANDIDATES))
        lower = max([s for s in self.buckets if s < at], default=0)
        cost = torch.tensor([t[w] for w in CANDIDATES])
        for b in range(lower + 1, at + 1):
            rates = b * self.e0 / cost / self.straggle[b]
            best = int(rates.argmax())
            self.table[b] = CANDIDATES[best] if rates[best] > self.margin * b / t[0] else 1
        self.known.add(at)
        self._table = None

    def choose(self, active: torch.Tensor) -> torch.Tensor:
        if self._table is None or self._table.device != active.device:
            self._table = torch.tensor(self.table, device=active.device)
        return self._table[active.sum()]


def preview(model: ImageModel, tokens: torch.Tensor, committed: int) -> Image.Image:
    """The picture of a decode in progress: `tokens` [length] decoded with its first
    `committed` positions final and every image cell after them grey."""
    lay = model.layout
    seq = tokens.clamp(0, model.vocab_size - 1)[None]
    image = model.decode(seq)[0]
    final = (torch.arange(seq.shape[1], device=seq.device) < committed)[None]
    cells = lay.image_tokens(final)[0].reshape(lay.grid[0], lay.grid[1])
    mask = Image.fromarray((cells.cpu().numpy() * 255).astype("uint8")).resize(
        image.size, Image.NEAREST)
    return Image.composite(image, Image.new(image.mode, image.size, (128,) * len(image.mode)),
                           mask)


def row_cost(sampling) -> int:  # noqa: ANN001
    """Sample rows one image takes: two under classifier-free guidance, else one."""
    return 2 if sampling.uses_cfg else 1


def lane_capacity(max_batch: int, max_rows: int, sampling) -> int:  # noqa: ANN001
    """Images a lane of this sampling holds: at most max_batch, and max_rows' worth of rows."""
    return min(max_batch, max_rows // row_cost(sampling))


def batch_buckets(capacity: int) -> list[int]:
    """The batch sizes whose cost curves window="auto" reads: powers of two up to `capacity`,
    and `capacity` itself."""
    return sorted({min(1 << k, capacity) for k in range(capacity.bit_length() + 1)})


def lane_setting(model: ImageModel, req: Request) -> tuple:
    """(rule, sampling, jacobi, auto) of a request's decode setting; plain AR runs as the sjd
    loop at window 1 (the same tokens); auto: whether the window is chosen per batch."""
    rule = build_rule(model, req.method, **req.options)
    if rule is None:
        rule = build_rule(model, "sjd")
    sampling = resolve_sampling(model, req.temperature, req.top_k, req.top_p, req.cfg_scale)
    window = 1 if req.method == "ar" else req.window
    jacobi = JacobiConfig(window=window if window != "auto" else max(CANDIDATES),
                          coupling=req.coupling, draft_init=req.draft_init)
    return rule, sampling, jacobi, window == "auto"


def lane_tag(session, rule, sampling, jacobi: JacobiConfig, drafter) -> str:  # noqa: ANN001
    """The cost-curve tag of a lane (loop.curve_tag, and the head where one drafts)."""
    tag = curve_tag(session, sampling, rule, jacobi)
    return tag if drafter is None else f"{tag}/head={drafter.head_id}:{drafter.cfg.depth}"


def head_prior(drafter, rule) -> dict[int, float] | None:  # noqa: ANN001
    """The tokens per iteration a draft head measured for this kind of rule, if any."""
    if drafter is None:
        return None
    prior = drafter.target.get("prior", {}).get("lossless" if rule.exact else "relaxed")
    return {int(w): float(e) for w, e in prior.items()} if prior else None


class Lane:
    """One decode setting's rows: a loop over a session of `capacity` rows; drafter: the
    engine's draft head, drafting every speculative lane's windows."""

    def __init__(self, model: ImageModel, req: Request, max_batch: int, max_rows: int,
                 drafter=None, metrics=None) -> None:  # noqa: ANN001
        self.model = model
        self.rule, self.sampling, jacobi, auto = lane_setting(model, req)
        self.row_cost = row_cost(self.sampling)
        self.capacity = capacity = lane_capacity(max_batch, max_rows, self.sampling)
        self.metrics = metrics  # the engine's EngineMetrics, where it keeps them
        self.session = model.start([None] * capacity, cfg=self.sampling.uses_cfg)
        head = drafter if req.method != "ar" else None
        tag = lane_tag(self.session, self.rule, self.sampling, jacobi, head)
        policy = (BatchWindow(model, self.rule, self.sampling, jacobi, capacity, tag,
                              prior=head_prior(head, self.rule))
                  if auto else WindowPolicy(int(jacobi.window)))
        self.policy = policy
        gens = [torch.Generator(device=model.device).manual_seed(0) for _ in range(capacity)]
        self.loop = Loop(model, self.session, self.rule, self.sampling, jacobi,
                         Raster(model, policy), gens, drafter=head)
        self.loop.state.retire(list(range(capacity)))
        self.slots: list[Request | None] = [None] * capacity

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is None]

    def busy(self) -> bool:
        return any(r is not None for r in self.slots)

    def rows(self) -> int:
        """Sample rows in flight: images, and their unconditional rows under guidance."""
        return self.row_cost * sum(r is not None for r in self.slots)

    def admit(self, row: int, req: Request) -> None:
        """Start `req` in free row `row`; if that fails, the row stays free (and retired)."""
        model, loop = self.model, self.loop
        try:
            model.admit(self.session, [row], [req.prompt])
            gen = torch.Generator(device=model.device).manual_seed(int(req.seed))
            loop.restart([row], [gen])
        except Exception:
            loop.state.retire([row])
            raise
        req.started = time.monotonic()
        req.first_iteration = loop.state.iteration
        self.slots[row] = req

    def drop(self, row: int) -> Request:
        req, self.slots[row] = self.slots[row], None
        self.loop.state.retire([row])
        return req

    def _previews(self, done: list[bool]) -> None:
        """Send each streaming request the previews it is due: preview k (of P) once
        (k + 1) / (P + 1) of its tokens are committed; the picture so far, the rest grey."""
        state = self.loop.state
        counts = state.count.tolist()
        for row, req in enumerate(self.slots):
            if req is None or not req.on_partial or done[row]:
                continue
            due = min(req.partial_images, counts[row] * (req.partial_images + 1) // state.length)
            while req.partials_sent < due:
                image = preview(self.model, state.tokens[row, : state.length], counts[row])
                try:
                    req.on_partial(req, req.partials_sent, image)
                except Exception:  # noqa: BLE001 - a listener's failure is not the decode's
                    LOG.exception("sending a preview failed")
                req.partials_sent += 1

    def step(self) -> list[tuple[Request, Completion]]:
        """One iteration of every image in the lane; -> the requests it finished."""
        active = [r for r in self.slots if r is not None]
        for r in active:
            r.batch_sum += len(active)
            r.iterations += 1
        if isinstance(self.policy, BatchWindow):  # a first batch of this size: read its curve
            self.policy.ensure(len(active))
        before = self.loop.state.count.clone()
        t0 = time.perf_counter()
        self.loop.step()
        state, lay = self.loop.state, self.model.layout
        if self.metrics is not None:
            self.metrics.iteration.observe(time.perf_counter() - t0)
            self.metrics.tokens.inc(int((state.count - before).sum()))
            self.metrics.forwards.inc(len(active))
        grid = (lay.grid[0], lay.grid[1])
        done = (state.count >= state.length).tolist()
        if any(r is not None and r.partial_images and r.on_partial for r in self.slots):
            self._previews(done)
        out = []
        for row, req in enumerate(self.slots):
            if req is None or not done[row]:
                continue
            tokens = state.tokens[row, : state.length].clone()
            steps = lay.image_tokens(state.step[row : row + 1, : state.length])[0]
            ent = lay.image_tokens(state.entropy[row : row + 1, : state.length])[0]
            hist = state.window_hist[row].tolist()
            image = self.model.decode(tokens[None])[0]
            now = time.monotonic()
            out.append((req, Completion(
                tokens=lay.image_tokens(tokens[None])[0].cpu(), image=image,
                forward_passes=int(state.forward_passes[row]),
                windows={w: n for w, n in enumerate(hist) if n},
                queue_s=req.started - req.submitted,
                decode_s=now - req.started,
                warmup_s=req.warmup_s,
                mean_batch=req.batch_sum / max(req.iterations, 1),
                commit_step=(steps - req.first_iteration).reshape(grid).cpu(),
                entropy=ent.reshape(grid).cpu())))
            self.drop(row)
        return out


class Engine:
    """Continuous batching over lanes (one per decode setting), `max_batch` images per lane.

    Work is counted in sample rows (an image under classifier-free guidance is two, its
    conditional and unconditional row): at most `max_rows` are in flight over all lanes (by
    default twice max_batch, so that images alone bound a lane), and a lane holds at most
    min(max_batch, max_rows // rows per image) images.

    submit() queues a request (QueueFull beyond `queue_size` waiting) and returns its Future;
    a background thread (start()) or run_once() calls admit waiting requests where their lane
    has a free row, drop cancelled or expired ones, and step every busy lane once. A future
    cancelled from outside retires its request within one iteration. Lanes without requests
    beyond `idle_lanes` are freed, least recently used first, and at most `max_lanes` exist at
    once (a request of a new setting waits for one to finish), so memory stays bounded at
    max_lanes sessions of max_batch rows whatever settings clients send."""

    def __init__(self, model: ImageModel, max_batch: int = 8, queue_size: int = 64,
                 idle_lanes: int = 2, max_lanes: int = 4, drafter=None,  # noqa: ANN001
                 max_rows: int | None = None) -> None:
        max_rows = 2 * max_batch if max_rows is None else max_rows
        if max_batch < 1 or queue_size < 1 or max_rows < 1:
            raise ValueError(f"max_batch, max_rows and queue_size must be >= 1, got "
                             f"{max_batch}, {max_rows}, {queue_size}")
        self.model, self.max_batch, self.queue_size = model, max_batch, queue_size
        self.max_rows = max_rows
        self.drafter = drafter  # a draft head (drafter/head.py) for every speculative lane
        self.idle_lanes = idle_lanes  # lanes kept without requests (KV rows, noise table)
        self.max_lanes = max(1, max_lanes)  # lanes at once: requests of a new setting wait
        self.waiting: collections.deque[Request] = collections.deque()
        self.lanes: dict[tuple, Lane] = {}
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.running = False
        self.batch_log: list[int] = []  # images stepped per iteration (all lanes)
        self.warming = False  # measuring cost curves (warm_up): /health says so
        self.drain_until: float | None = None  # set by drain(): no admissions, then stop
        self.warm_end: float | None = None
        from .metrics import EngineMetrics

        self.metrics = EngineMetrics(self)  # Prometheus: the server's /metrics

    def warm_up(self, req: Request, budget_s: float = 120.0) -> None:
        """Measure, before serving, the cost curves that window="auto" lanes of `req`'s setting
        read (batch sizes at powers of two up to a lane's; cached on disk, so a restart on the
        same machine reads them). Bounded: sizes not reached within `budget_s` use the device
        kind's reference curve. Requests submitted meanwhile wait in the queue."""
        self.warming = True
        try:
            rule, sampling, jacobi, auto = lane_setting(self.model, req)
            if not auto:
                return
            deadline = time.monotonic() + budget_s
            for b in batch_buckets(lane_capacity(self.max_batch, self.max_rows, sampling)):
                if time.monotonic() > deadline:
                    print(f"speculaas: warm-up stopped after {budget_s:.0f} s; batch sizes from "
                          f"{b} on use the reference cost curve", file=sys.stderr, flush=True)
                    break
                session = self.model.start([None] * b, cfg=sampling.uses_cfg)
                measure_cost_curve(self.model, session, sampling, (0, *CANDIDATES), rule,
                                   jacobi, drafter=self.drafter,
                                   tag=lane_tag(session, rule, sampling, jacobi, self.drafter))
        finally:
            self.warming, self.warm_end = False, time.monotonic()

    def check(self, req: Request) -> None:
        """The ValueError a request would meet (bad method, options, prompt) before queueing."""
        self.model.check_prompts([req.prompt])
        build_rule(self.model, req.method, **req.options)
        sampling = resolve_sampling(self.model, req.temperature, req.top_k, req.top_p,
                                    req.cfg_scale)
        JacobiConfig(window=req.window, coupling=req.coupling, draft_init=req.draft_init)
        if row_cost(sampling) > self.max_rows:
            raise ValueError("an image under guidance takes 2 sample rows (conditional and "
                             f"unconditional); this server runs {self.max_rows} at once")

    def rows_in_flight(self) -> int:
        return sum(lane.rows() for lane in list(self.lanes.values()))

    def submit(self, req: Request) -> Future:
        self.check(req)
        if self.drain_until is not None:
            raise ShuttingDown("the server is shutting down")
        with self.wake:
            if len(self.waiting) >= self.queue_size:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already")
            self.waiting.append(req)
            self.wake.notify()
        return req.future

    def _finish(self, req: Request, result: Completion | None = None,
                error: Exception | None = None) -> None:
        """Settle a request's future and count its outcome."""
        outcome = ("ok" if error is None else "cancelled" if isinstance(error, Cancelled)
                   else "error")
        self.metrics.requests.labels(outcome).inc()
        if result is not None and result.forward_passes:
            self.metrics.compression.observe(len(result.tokens) / result.forward_passes)
        _settle(req.future, result, error)

    def submit_many(self, reqs: list[Request]) -> list[Future]:
        """Queue as many of `reqs` as the queue has room for, in one step (the engine sees
        them together), and return their futures; QueueFull when none fits. The caller has
        checked them (check()): the images of one API call share their setting."""
        if self.drain_until is not None:
            raise ShuttingDown("the server is shutting down")
        with self.wake:
            room = self.queue_size - len(self.waiting)
            if room <= 0:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already")
            self.waiting.extend(reqs[:room])
            self.wake.notify()
        return [r.future for r in reqs[:room]]

    def _expired(self, req: Request, now: float) -> bool:
        if req.cancelled.is_set() or req.future.cancelled():
            self._finish(req, error=Cancelled("cancelled"))
            return True
        if req.deadline is not None and now > req.deadline:
            self._finish(req, error=Cancelled("its time limit ran out"))
            return True
        return False

    def run_once(self) -> bool:
        """Admit, drop, step once. -> whether anything was running or waiting."""
        now = time.monotonic()
        for lane in self.lanes.values():  # first free the rows of cancelled requests
            for row, req in enumerate(lane.slots):
                if req is not None and self._expired(req, now):
                    lane.drop(row)
        with self.wake:
            self.waiting = collections.deque(r for r in self.waiting
                                             if not self._expired(r, now))
            queue = list(self.waiting)
        admitted, rows = [], self.rows_in_flight()
        for req in queue:
            key = req.lane_key()
            lane = self.lanes.get(key)
            if lane is None and len(self.lanes) >= self.max_lanes:
                idle = next((k for k, other in self.lanes.items() if not other.busy()), None)
                if idle is None:
                    continue  # every lane is busy: wait for one to finish
                del self.lanes[idle]  # the least recently used idle lane makes room
            if lane is None:
                try:
                    lane = self.lanes[key] = Lane(self.model, req, self.max_batch,
                                                  self.max_rows, self.drafter, self.metrics)
                except Exception as e:  # noqa: BLE001 - this request fails, with its cause
                    if not isinstance(e, ValueError):
                        LOG.exception("building a lane for %s failed", key)
                    self._finish(req, error=e)
                    admitted.append(req)
                    continue
            self.lanes[key] = self.lanes.pop(key)  # most recently used last
            free = lane.free()
            if free and rows + lane.row_cost <= self.max_rows:
                if self.warm_end is not None:
                    req.warmup_s = max(0.0, min(self.warm_end, time.monotonic()) - req.submitted)
                try:
                    lane.admit(free[0], req)
                    rows += lane.row_cost
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    LOG.exception("admitting a request failed")
                    self._finish(req, error=e)
                admitted.append(req)
        with self.wake:
            for req in admitted:
                self.waiting.remove(req)
        stepped = 0
        for lane in self.lanes.values():
            if not lane.busy():
                continue
            stepped += sum(r is not None for r in lane.slots)
            for req, done in lane.step():
                self._finish(req, result=done)
        if stepped:
            self.batch_log.append(stepped)
        idle = [k for k, lane in self.lanes.items() if not lane.busy()]
        for key in idle[: max(0, len(idle) - self.idle_lanes)]:  # least recently used first
            del self.lanes[key]
        return bool(stepped) or bool(self.waiting)

    def serve_forever(self, warm: Request | None = None, budget_s: float = 120.0) -> None:
        """Run the engine in this thread until stop(). Servers run it on the main thread and
        the HTTP server beside it: on a 2-core CPU, PyTorch's kernels called from a second
        thread ran 1.3-1.9x slower (sjd, window 16: 1.3-1.7 s per image against 0.78 s on the
        main thread, the same forwards), as the second thread gets an OpenMP team of its own
        beside the main thread's. warm: measure the cost curves of this request's setting
        first (warm_up), while /health says "warming_up"."""
        self.running = True
        if warm is not None:
            self.warm_up(warm, budget_s)
        self._serve()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Stop gracefully (a server's SIGTERM): take no new requests, fail the waiting ones
        (the server is shutting down), let the running ones finish for up to `timeout_s`, fail
        what is left, then stop. Every client gets an answer. Safe from a signal handler."""
        self.drain_until = time.monotonic() + timeout_s  # the loop notices within 0.5 s

    def _drained(self) -> bool:
        """While draining: fail what waits (and, past the deadline, what runs); True when
        nothing is left and the engine may stop."""
        stop = Cancelled("the server is shutting down")
        with self.wake:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for req in waiting:
            self._finish(req, error=stop)
        if time.monotonic() > self.drain_until:
            self._fail_all(stop)
        return not any(lane.busy() for lane in self.lanes.values())

    def _serve(self) -> None:
        with torch.inference_mode():
            while self.running:
                if self.drain_until is not None and self._drained():
                    LOG.info("shut down: every request answered")
                    self.running = False
                    break
                try:
                    busy = self.run_once()
                except Exception as e:  # noqa: BLE001 - fail every request, keep serving
                    LOG.exception("an engine iteration failed; failing its requests")
                    self._fail_all(e)
                    busy = False
                if not busy:
                    with self.wake:
                        if self.running and not self.waiting:
                            self.wake.wait(timeout=0.5)

    def _fail_all(self, error: Exception) -> None:
        for lane in self.lanes.values():
            for row, req in enumerate(lane.slots):
                if req is not None:
                    lane.drop(row)
                    self._finish(req, error=error)
        self.lanes.clear()

    def start(self) -> Engine:
        """Run the engine on a background thread (tests, in-process use; see serve_forever)."""
        if self.thread is None:
            self.running = True
            self.thread = threading.Thread(target=self._serve, name="speculaas-engine",
                                           daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        self.running = False
        with self.wake:
            self.wake.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)
            self.thread = None
