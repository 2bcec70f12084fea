"""Type checks for option values at the public boundary (bottom layer: imports nothing of ours).

Options arrive from Python, numpy, JSON and the command line; a numpy float32 is as good a
number as a Python float, while a bool is never a number and 16.0 is not an integer.
"""

from __future__ import annotations

import numbers

import numpy as np


def is_number(value) -> bool:  # noqa: ANN001
    """A real number of any width (Python or numpy), not a bool, not NaN."""
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and value == value)


def is_integer(value) -> bool:  # noqa: ANN001
    """An integer of any width (Python or numpy), not a bool; floats such as 16.0 are not."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_positive_ints(obj, names, what: str = "") -> None:  # noqa: ANN001
    """Each field `names` of a configuration `obj` is a Python int >= 1 (configurations written
    to JSON and read back: no numpy ints, no bools); ValueError naming the first that is not."""
    for k in names:
        v = getattr(obj, k)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{what}{k} must be an integer >= 1, got {v!r}")
