"""Acceptance rules by name: `get("csd", lam=0.5, delta=0.65)`."""

from __future__ import annotations

import dataclasses

from . import functional
from .base import AcceptanceRule, check_inputs
from .baselines import Addition, Amplify
from .entropy import CSD
from .grouped import GSD
from .lantern import Lantern
from .lossless import SJD

RULES: dict[str, type[AcceptanceRule]] = {
    cls.name: cls for cls in (SJD, CSD, GSD, Lantern, Amplify, Addition)
}


def options(name: str) -> tuple[str, ...]:
    """The hyperparameters a rule takes by name (model data such as codebooks excluded)."""
    cls = _rule_class(name)
    return tuple(f.name for f in dataclasses.fields(cls) if f.init and f.name not in cls.needs)


def _rule_class(name: str) -> type[AcceptanceRule]:
    if name not in RULES:
        raise ValueError(f"unknown acceptance rule {name!r}; valid: {tuple(RULES)}")
    return RULES[name]


def get(name: str, **kwargs) -> AcceptanceRule:
    """Build the rule `name` with its options (and model data such as `codebook=`)."""
    cls = _rule_class(name)
    valid = set(options(name)) | set(cls.needs)
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {name!r}; "
                         f"valid: {sorted(options(name))}")
    return cls(**kwargs)


__all__ = ["RULES", "AcceptanceRule", "get", "options", "functional", "check_inputs",
           "SJD", "CSD", "GSD", "Lantern", "Amplify", "Addition"]
