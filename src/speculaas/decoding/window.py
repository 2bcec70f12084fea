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

# model -> {(batch, cfg): {window: seconds}}; measured once per process.
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measure_cost_curve(model, session: Session, cfg: bool, windows: tuple[int, ...],  # noqa: ANN001
                       repeats: int = 3) -> dict[int, float]:
    """Median wall time of one forward of each window size for this batch, in seconds, with
    the target-probability work included. Runs on the decode's own session at offset 0: what a
    window writes past a committed prefix never influences later results (the Session
    contract), so the measurement leaves no trace."""
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
                target_probs(cond, uncond, sampling).cumsum(-1)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            costs[w] = statistics.median(times)
    _COSTS[model][key] = {**(cached or {}), **costs}
    return {w: costs[w] for w in windows}


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

    E_i(W) = (1 - a_i^W) / (1 - a_i), the expected tokens committed by a window of W when each
    draft is accepted with probability a_i given the ones before it were (the standard
    speculative-decoding model). a_i is the image's own acceptance rate over every slot it
    verified, counts decayed by `decay` per iteration (the content changes along the image),
    under a Beta prior of mean `prior` and weight 2. Pooling over slots lets what short windows
    observe inform the value of long ones.
    t(W) is the measured cost of a window forward with its target-probability work. The choice
    depends only on that curve and on the image's own history, so with the curve fixed (cached
    for the process, or given as `cost`) the same seed gives the same image; across machines
    the measured curve, and so the windows, may differ (lossless rules stay exact either way).
    `cost`: a measured or given curve {window: seconds}; None measures it on first use.
    """

    def __init__(self, max_window: int = 64, candidates: tuple[int, ...] = CANDIDATES,
                 cost: dict[int, float] | None = None, decay: float = 0.9,
                 prior: float = 0.5) -> None:
        super().__init__(max_window)
        self.candidates = tuple(w for w in candidates if w <= max_window) or (max_window,)
        self.cost, self.decay, self.prior = cost, decay, prior

    def begin(self, model, session: Session, cfg: bool) -> None:  # noqa: ANN001
        super().begin(model, session, cfg)
        batch, device = session.batch_size, model.device
        curve = self.cost if self.cost is not None else measure_cost_curve(
            model, session, cfg, self.candidates)
        self.curve = curve
        self.cand = torch.tensor(self.candidates, device=device)
        self.t = torch.tensor([curve[w] for w in self.candidates], device=device,
                              dtype=torch.float32)
        self.reached = torch.zeros(batch, device=device)
        self.accepted = torch.zeros(batch, device=device)

    def choose(self, act: torch.Tensor) -> torch.Tensor:
        alpha = ((self.accepted[act] + 2 * self.prior) / (self.reached[act] + 2)).clamp(max=0.999)
        expected = (1 - alpha[:, None] ** self.cand) / (1 - alpha[:, None])  # [b, candidates]
        return self.cand[(expected / self.t).argmax(1)]

    def observe(self, act: torch.Tensor, window: torch.Tensor, outputs: torch.Tensor,
                accepted: torch.Tensor) -> None:
        super().observe(act, window, outputs, accepted)
        # Slots verified this iteration: the accepted ones plus the first rejection, if any.
        verified = torch.minimum(accepted + 1, outputs - 1).clamp(min=0).float()
        self.reached[act] = self.reached[act] * self.decay + verified
        self.accepted[act] = self.accepted[act] * self.decay + accepted.float()


def make_policy(window) -> WindowPolicy:  # noqa: ANN001
    """int -> fixed window; "auto" -> AutoWindow(); a WindowPolicy is used as given."""
    if isinstance(window, WindowPolicy):
        return window
    if window == "auto":
        return AutoWindow()
    return WindowPolicy(int(window))
