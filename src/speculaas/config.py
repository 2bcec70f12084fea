"""Frozen configuration objects. The CLI and `generate()` map their options onto these."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Names of the drafters in decoding/drafting.py (checked against its registries in the tests).
DRAFT_INITS = ("uniform", "onehot", "vertical", "vertical_sample")
COUPLINGS = ("none", "maximal", "gumbel")
ADVANCE_MODES = ("per_image", "batch_min")


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become the target distribution. Applied once, before any acceptance rule.

    cfg_scale: classifier-free guidance `uncond + cfg_scale * (cond - uncond)` on logits; None or
        1 disables the unconditional branch.
    temperature: > 0. top_k: keep the k largest logits (None: all). top_p: nucleus mass in (0, 1].
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    cfg_scale: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r} "
                             "(for greedy decoding use top_k=1)")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.cfg_scale is not None and not math.isfinite(self.cfg_scale):
            raise ValueError(f"cfg_scale must be finite, got {self.cfg_scale!r}")

    @property
    def uses_cfg(self) -> bool:
        return self.cfg_scale is not None and self.cfg_scale != 1.0


@dataclass(frozen=True)
class JacobiConfig:
    """The speculative Jacobi loop.

    window: W input slots per forward (the last committed token + W - 1 drafts), so at most W
        tokens are committed per target forward. W = 1 is plain autoregressive decoding.
        "auto": chosen per iteration and image from the measured cost of a window forward and
        the image's acceptance so far (decoding/window.py), up to 64.
    draft_init: what fresh draft slots hold: "uniform" (a uniform random token whose draft
        distribution is uniform, as CSD does), "onehot" (the same token, declared one-hot at
        itself, as SJD's code does; accepted less often), "vertical" (the token one row above,
        declared one-hot), "vertical_sample" (a sample from the target distribution stored for
        the slot above, declared as that distribution).
    coupling: how tail slots after the first rejection become the next drafts: "none"
        (independent redraw from the new target, SJD), "maximal" (keep the old draft with
        probability min(1, target/draft), else draw from the residual), "gumbel" (argmax of
        log target + Gumbel noise fixed per image and position). All exact for every rule.
    advance: "per_image" (each image commits its own accepted prefix) or "batch_min" (every image
        advances by the batch's smallest accepted length, as the reference code does; biased and
        slower, kept for comparison).
    """

    window: int | str = 16
    draft_init: str = "uniform"
    coupling: str = "none"
    advance: str = "per_image"

    def __post_init__(self) -> None:
        if self.window != "auto" and (not isinstance(self.window, int)
                                      or isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"window must be an integer >= 1 or 'auto', got {self.window!r}")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"unknown draft_init {self.draft_init!r}; valid: {DRAFT_INITS}")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"unknown coupling {self.coupling!r}; valid: {COUPLINGS}")
        if self.advance not in ADVANCE_MODES:
            raise ValueError(f"unknown advance {self.advance!r}; valid: {ADVANCE_MODES}")
