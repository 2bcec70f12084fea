"""Speculative Jacobi Decoding (Teng et al., "Accelerating Auto-regressive Text-to-Image
Generation with Training-free Speculative Jacobi Decoding", ICLR 2025, Eq. 3).

Accept draft x with probability min(1, target(x) / draft(x)); at the first rejection resample
from norm(max(0, target - draft)). Lossless: the output is distributed exactly as AR sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import AcceptanceRule


@dataclass(frozen=True)
class SJD(AcceptanceRule):
    name = "sjd"
    lossless = True
