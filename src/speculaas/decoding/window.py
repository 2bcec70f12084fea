"""The window policy: how many slots each image gets in the next forward.

A fixed window is the classic choice, but the right one depends on the hardware: on a 2-core CPU
a 16-slot iteration of the built-in model costs ~2.4 AR steps and a 64-slot one ~6, on a GPU a
7B model's 64-slot forward costs about one step. `AutoWindow` reads a cost curve t(W) (costs.py:
where it comes from) and, every iteration, picks the W that maximises the batch's expected
committed tokens per second, from a measured prior of what each window commits and each image's
running acceptance.

The choice only ever depends on what has already been committed and verified and on timings,
never on the drafts it keeps or drops, so every lossless rule stays lossless (tested on the toy
model), and a sample-exact one draws AR's very tokens whatever the timings say.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from ..models.base import Session
from .costs import CurveSource, OnlineCurve

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

class WindowPolicy:
    """A fixed window: every image gets `window` slots every iteration."""

    def __init__(self, window: int) -> None:
        self.max_window = window

    def begin(self, model, session: Session, cfg: bool, lossless: bool = True,  # noqa: ANN001
              costs: CurveSource | None = None) -> None:  # noqa: B027 - optional hook
        """Called once per decode; `lossless`: whether the rule is exact (policies with priors
        per kind of rule use it); costs: where this decode's cost curve comes from (costs.py)."""

    def choose(self, active: torch.Tensor) -> torch.Tensor:
        """active [B] bool: unfinished images -> the batch's window (a 0-d long tensor on the
        device: the loop reads it with everything else in its one synchronisation)."""
        return torch.tensor(self.max_window, device=active.device)

    def started(self, window: int, active: int) -> None:  # noqa: B027 - optional hook
        """Told on the host, right after the loop's synchronisation, that an iteration at
        `window` with `active` unfinished images starts now (the previous one has ended)."""

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

    t(W) is the cost of one iteration of the loop at window W for this batch: the curve given
    as `cost`, else the decode's (costs.CurveSource). Where the decode may learn it (its windows
    cannot change a token), every iteration with the whole batch active is timed between two
    of the loop's synchronisations (free: the loop synchronises anyway), the curve is refreshed
    every `refresh` iterations, and a window not yet timed whose promise at the prior is within
    `explore` of the best is run for a few iterations (`OnlineCurve.min_samples`) to time it.
    Nothing is timed before the first token. `clock`: the timer (seconds), e.g. a slow or noisy
    one in tests. learn=False keeps the curve the decode starts from (a benchmark's shards and
    resumed halves then choose alike).

    E_i(W) = 1 + r_i (E(W) - 1): E(W) is the prior tokens per iteration of a decode that keeps
    window W (`PRIOR_TOKENS` for lossless or relaxed rules, interpolated between the windows
    listed and flat after the last), r_i how image i's accepted drafts compare with what the
    prior expects at the windows it got: a ratio of sums decayed by `decay` per iteration and
    shrunk towards 1 by `strength` pseudo-iterations. The batch keeps its window until another
    one promises `stickiness` times its rate. A run of rejections (r < 1) shortens the window,
    down to W = 1; a single-token iteration verifies nothing, so r decays back towards 1 and the
    long window returns.

    Why a prior measured at fixed windows and not per-slot acceptance measured online: a draft
    is refined once per iteration it spends in the window before it is verified, so what a
    short window observes is far below what the same slot reaches in a long one, and a policy
    that trusts its short-window statistics talks itself into short windows. Quick reactions
    do not pay either: acceptance comes in bursts (a whole row of sky, then a rejection at the
    first draft), so the evidence is weighted over tens of iterations. One W for the whole
    batch: the forward is as wide as its widest window anyway. A batch takes as many iterations
    as its slowest image, so the batch's rate is divided by 1 + spread sqrt(W) z_b (z_b: the
    expected maximum of b standard normals; `spread`: the coefficient of variation of forward
    counts across captions per sqrt(W), docs/benchmarks.md).

    If at the prior no window beats plain AR decoding (the curve's window 0, an AR step; else
    its window 1) by `margin` in tokens per second, the decode is plain AR (`plain_ar`): a
    compute-bound batch, or a rule whose acceptance cannot pay for the window on this machine.
    With the curve fixed (given as `cost`, or a relaxed rule's reference curve) the same seeds
    and batch give the same images on every machine of a device kind.
    `prior`: a table {W: tokens per iteration} used whatever the rule; None: PRIOR_TOKENS.
    """

    def __init__(self, max_window: int = 64, candidates: tuple[int, ...] = CANDIDATES,
                 cost: dict[int, float] | None = None, prior: dict[int, float] | None = None,
                 decay: float = 0.97, strength: float = 64.0, stickiness: float = 1.1,
                 margin: float = 1.05, spread: float = 0.035, refresh: int = 4,
                 explore: float = 1.15, clock: Callable[[], float] = time.perf_counter,
                 learn: bool = True) -> None:
        super().__init__(max_window)
        self.candidates = tuple(w for w in candidates if w <= max_window) or (max_window,)
        self.cost, self.prior = cost, None if prior is None else dict(prior)
        self.decay, self.strength, self.stickiness, self.margin = (decay, strength, stickiness,
                                                                    margin)
        self.spread, self.refresh, self.explore, self.clock = spread, refresh, explore, clock
        self.learn = learn
        self.online: OnlineCurve | None = None

    def start_curve(self, costs: CurveSource | None) -> dict[int, float]:
        """The curve a decode starts from over (0, *candidates): the given `cost`, else costs'."""
        if self.cost is not None:
            return self.cost
        if costs is None:
            raise ValueError("AutoWindow needs a cost curve: give `cost`, or let the decoding "
                             "loop give one")
        return costs.open().curve((0, *self.candidates))

    def begin(self, model, session: Session, cfg: bool, lossless: bool = True,  # noqa: ANN001
              costs: CurveSource | None = None) -> None:
        batch, device = session.batch_size, model.device
        if self.cost is not None:  # a given curve: choose among the windows it lists
            listed = tuple(w for w in self.candidates if w in self.cost)
            if not listed:
                raise ValueError(f"the cost curve lists none of the windows {self.candidates}")
            self.candidates = listed
        curve = self.start_curve(costs)
        learn = self.cost is None and self.learn and costs.learn
        self.online = costs.online if learn else None
        prior = self.prior or PRIOR_TOKENS["lossless" if lossless else "relaxed"]
        self.batch, self.curve, self.device = batch, curve, device
        self.cand = torch.tensor(self.candidates, device=device)
        self._set_costs(curve)
        self.prior_e = [prior_tokens(prior, w) for w in self.candidates]
        self.e0 = torch.tensor(self.prior_e, device=device)
        self.straggle = straggler_factor(self.cand, batch, self.spread)
        self.seen = torch.zeros(batch, device=device)  # decayed accepted drafts
        self.expected = torch.zeros(batch, device=device)  # decayed prior expectation
        gain = self._gain(torch.ones(batch, dtype=torch.bool, device=device))
        self.current = gain.argmax()  # index into candidates, kept on the device
        plain = batch / curve[0] if 0 in curve else gain[self.cand.argmin()]
        self._never = bool(gain.max() <= self.margin * plain)
        self._last: tuple[float, int, bool] | None = None
        self._ticks, self._explore = 0, []  # pending exploration: candidate indices

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
        if self._explore:  # time a promising window not yet timed (host-decided, no sync)
            self.current = torch.tensor(self._explore.pop(), device=self.device)
            return self.cand[self.current]
        gain = self._gain(active)
        best = gain.argmax()
        self.current = torch.where(gain[best] > self.stickiness * gain[self.current], best,
                                   self.current)
        return self.cand[self.current]

    def started(self, window: int, active: int) -> None:
        if self.online is None:
            return
        now = self.clock()
        if self._last is not None and self._last[2]:  # the last iteration ran the whole batch
            self.online.add(self._last[1], now - self._last[0])
        self._last = (now, window, active == self.batch)
        self._ticks += 1
        if self._ticks % self.refresh == 0 and not self._explore:
            self._update()

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:
        # Near the end of an image fewer slots are usable: expect what the largest candidate
        # that fits would commit.
        fits = (self.cand[None] <= outputs[:, None]).sum(1).clamp(min=1) - 1
        self.seen[act] = self.seen[act] * self.decay + accepted.float()
        self.expected[act] = self.expected[act] * self.decay + (self.e0[fits] - 1)

    def _set_costs(self, curve: dict[int, float]) -> None:
        """t [candidates]: the curve's seconds per iteration at each candidate window."""
        self.t = torch.tensor([curve[w] for w in self.candidates], device=self.device,
                              dtype=torch.float32)

    def _update(self) -> None:
        """Refresh t(W) from the timings, and queue the most promising untimed window."""
        curve = self.online.curve(self.candidates)
        self._set_costs(curve)
        rate = [e / curve[w] for e, w in zip(self.prior_e, self.candidates, strict=True)]
        best = max(rate)
        untimed = [i for i, w in enumerate(self.candidates)
                   if rate[i] * self.explore >= best and not self.online.known(w)]
        if untimed:
            i = max(untimed, key=rate.__getitem__)
            self._explore = [i] * self.online.min_samples


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


def make_policy(window) -> WindowPolicy:  # noqa: ANN001
    """int -> fixed window; "auto" -> AutoWindow(); a WindowPolicy is used as given."""
    if isinstance(window, WindowPolicy):
        return window
    if window == "auto":
        return AutoWindow()
    return WindowPolicy(int(window))
