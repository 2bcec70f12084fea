"""The window policy: how many slots each image gets in the next forward.

A fixed window is the classic choice, but the right one depends on the hardware: on a 2-core CPU
a 64-slot forward of the built-in model costs ~2.6 AR steps, on a GPU a 7B model's 64-slot
forward costs about one. `AutoWindow` measures the cost curve t(W) of a window forward (once per
model, batch size and guidance setting, then cached) and, every iteration and for every image,
picks the W that maximises expected committed tokens per second, E_i(W) / t(W), from that
image's running acceptance statistics.

The choice only ever depends on what has already been committed and verified, never on the
drafts it keeps or drops, so every lossless rule stays lossless (tested on the toy model).
"""

from __future__ import annotations

import statistics
import time
import weakref

import torch

from ..config import SamplingConfig
from ..models.base import Session
from ..sampling import target_probs

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Prior rejection hazards of slot buckets {0}, {1,2}, {3..6}, {7..14}, deeper: fitted to the
# accepted-length histograms of sjd and csd at window 16 on the built-in model (hazard at the
# first draft 0.55-0.60, then 0.21-0.28, 0.13-0.17, 0.19-0.22; docs/bench/results).
PRIOR_HAZARDS = (0.6, 0.25, 0.15, 0.2)

# model -> {(batch, cfg): {window: seconds}}; measured once per process.
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measure_cost_curve(model, session: Session, cfg: bool, windows: tuple[int, ...],  # noqa: ANN001
                       repeats: int = 3) -> dict[int, float]:
    """Median wall time of one iteration at each window size for this batch, in seconds: the
    forward with its target-probability work, and for W > 1 the verification and redrafting
    of the window (sjd with maximal coupling on the window's own targets), which is what a
    speculative iteration costs beyond an AR step. Runs on the decode's own session at offset
    0: what a window writes past a committed prefix never influences later results (the
    Session contract), so the measurement leaves no trace."""
    key = (session.batch_size, cfg)
    cached = _COSTS.setdefault(model, {}).get(key)
    if cached is not None and all(w in cached for w in windows):
        return {w: cached[w] for w in windows}
    dev = model.device
    images = torch.arange(session.batch_size, device=dev)
    start = torch.zeros(session.batch_size, dtype=torch.long, device=dev)
    sampling = SamplingConfig(cfg_scale=2.0 if cfg else None)
    costs = {}
    with torch.inference_mode():
        for w in (windows[0], *windows):  # the first call warms caches and allocators
            times = []
            for _ in range(repeats):
                inputs = torch.zeros(session.batch_size, w, dtype=torch.long, device=dev)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                cond, uncond = session.forward(inputs, start, images)
                q = target_probs(cond, uncond, sampling)
                if w > 1:
                    _verify_like_a_window(q, inputs, images, start, w)
                else:
                    q.cumsum(-1)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            costs[w] = statistics.median(times)
    _COSTS[model][key] = {**(cached or {}), **costs}
    return {w: costs[w] for w in windows}


def _verify_like_a_window(q: torch.Tensor, inputs: torch.Tensor, images: torch.Tensor,
                          start: torch.Tensor, w: int) -> None:
    """The per-iteration work of the Jacobi loop after the forward, on stand-in drafts."""
    from ..acceptance import get
    from .drafting import Maximal
    from .jacobi import verify_window

    b, dev = len(images), q.device
    drafts = inputs[:, 1:]
    rnd = torch.rand(b, 3 * w + 1, device=dev)
    outputs = torch.full((b,), w, device=dev)
    pos = start[:, None] + torch.arange(w, device=dev)
    verify_window(get("sjd"), Maximal(q.shape[-1], [], dev), images, drafts, q[:, :-1], q, pos,
                  outputs, rnd, w)


class WindowPolicy:
    """A fixed window: every image gets `window` slots every iteration."""

    def __init__(self, window: int) -> None:
        self.max_window = window

    def begin(self, model, session: Session, cfg: bool) -> None:  # noqa: ANN001
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
    """Compute-aware window: argmax over W of E_i(W) / t(W) per image and iteration.

    E_i(W) = 1 + sum_{j < W - 1} S_i(j), the expected tokens a window of W commits, where S_i(j)
    is the chance that drafts 0..j are all accepted. S_i comes from per-slot rejection hazards
    h(j) = P(draft j rejected | drafts before it accepted), estimated per image like a
    survival curve with censoring (a window of W observes slots up to W - 2 only), in slot
    buckets {0}, {1, 2}, {3..6}, {7..14}, ... so deep slots share evidence, under Beta priors
    of means `prior` (one per bucket, the last one for all deeper buckets) and weight 2,
    counts decayed by `decay` per iteration (the content changes along the image). Unlike one acceptance rate
    with geometric decay, the hazards see that accepted drafts come in bursts: a rejection is
    likely at the first draft and rare once a run has started (whole rows under vertical
    drafts), which is what makes long windows pay.
    t(W) is the measured cost of a window forward with its target-probability work. The choice
    depends only on that curve and on the image's own history, so with the curve fixed (cached
    for the process, or given as `cost`) the same seed gives the same image; across machines
    the measured curve, and so the windows, may differ (lossless rules stay exact either way).
    `cost`: a measured or given curve {window: seconds}; None measures it on first use.
    """

    def __init__(self, max_window: int = 64, candidates: tuple[int, ...] = CANDIDATES,
                 cost: dict[int, float] | None = None, decay: float = 0.9,
                 prior: tuple[float, ...] = PRIOR_HAZARDS, margin: float = 1.1) -> None:
        super().__init__(max_window)
        self.candidates = tuple(w for w in candidates if w <= max_window) or (max_window,)
        self.cost, self.decay, self.prior, self.margin = cost, decay, tuple(prior), margin

    def begin(self, model, session: Session, cfg: bool) -> None:  # noqa: ANN001
        super().begin(model, session, cfg)
        batch, device = session.batch_size, model.device
        curve = self.cost if self.cost is not None else measure_cost_curve(
            model, session, cfg, self.candidates)
        self.curve = curve
        self.cand = torch.tensor(self.candidates, device=device)
        self.t = torch.tensor([curve[w] for w in self.candidates], device=device,
                              dtype=torch.float32)
        slots = torch.arange(self.max_window, device=device)
        bucket = torch.floor(torch.log2(slots + 1.0)).long()  # 0 | 1-2 | 3-6 | 7-14 | ...
        self.to_bucket = torch.nn.functional.one_hot(bucket).float()  # [slots, buckets]
        n_buckets = self.to_bucket.shape[1]
        prior = self.prior + (self.prior[-1],) * max(0, n_buckets - len(self.prior))
        self.h0 = torch.tensor(prior[:n_buckets], device=device)
        self.at_risk = torch.zeros(batch, n_buckets, device=device)
        self.events = torch.zeros(batch, n_buckets, device=device)
        # Before anything is observed every image holds the prior; if even then no window
        # beats a single token per cost by `margin` (the loop's bookkeeping beyond the measured
        # forward and verification), speculation cannot pay here: a compute-bound batch.
        gain = self._gain(torch.zeros(1, dtype=torch.long, device=device))[0]
        single = gain[self.cand == 1].max() if bool((self.cand == 1).any()) else gain.min()
        self._never = bool(gain.max() <= self.margin * single)

    def plain_ar(self) -> bool:
        return self._never

    def survival(self, act: torch.Tensor) -> torch.Tensor:
        """[b, max_window] chance that drafts 0..j are all accepted, per active image."""
        hazard = (self.events[act] + 2 * self.h0) / (self.at_risk[act] + 2)
        per_slot = hazard @ self.to_bucket.T  # [b, slots]
        return torch.cumprod(1 - per_slot.clamp(max=1.0), 1)

    def _gain(self, act: torch.Tensor) -> torch.Tensor:
        """[b, candidates] expected tokens per second of each candidate window."""
        gained = torch.cat([torch.ones_like(act[:, None], dtype=torch.float32),
                            1 + self.survival(act).cumsum(1)], 1)  # E(W) for W = 1, 2, ...
        return gained[:, self.cand - 1] / self.t

    def choose(self, act: torch.Tensor) -> torch.Tensor:
        return self.cand[self._gain(act).argmax(1)]

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:
        super().observe(act, window, outputs, accepted)
        slots = torch.arange(self.max_window, device=act.device)
        drafts = (outputs - 1).clamp(min=0)[:, None]  # slots verified at most
        risk = slots < torch.minimum(accepted[:, None] + 1, drafts)
        event = (slots == accepted[:, None]) & (accepted[:, None] < drafts)
        self.at_risk[act] = self.at_risk[act] * self.decay + risk.float() @ self.to_bucket
        self.events[act] = self.events[act] * self.decay + event.float() @ self.to_bucket


def make_policy(window) -> WindowPolicy:  # noqa: ANN001
    """int -> fixed window; "auto" -> AutoWindow(); a WindowPolicy is used as given."""
    if isinstance(window, WindowPolicy):
        return window
    if window == "auto":
        return AutoWindow()
    return WindowPolicy(int(window))
