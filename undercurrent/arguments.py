"""Checks of plain arguments that every layer shares (an on/off option, a number).

Errors are part of the interface: each check names the argument and says what it
takes, instead of letting a bad value fail deep inside pandas or numpy, or run
wrongly (``"no"`` is truthy). Like :mod:`undercurrent.errors`, this module sits
at the bottom of the layers: it imports nothing of the package.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def check_flag(name: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` as a bool when it is one, a numpy bool included (``mask.any()``), or
    None where ``optional``; else a ``TypeError`` naming ``name`` ("no" is not
    False, nor is 0)."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be True or False{' or None' if optional else ''}, got "
                    f"{type(value).__name__} ({value!r:.40})")


def check_number(name: str, value: Any, *, integer: bool = False, finite: bool = False) -> Any:
    """``value`` as a plain Python ``int`` (where ``integer``) or ``float`` when it
    is a number, numpy scalars included (a library downstream may refuse a numpy
    float32); else a ``TypeError`` naming ``name``. ``bool`` is refused: ``True``
    is not 1 token, and ``"0.5"`` is not a number. Where ``finite``, a NaN or an
    infinity is a ``ValueError`` naming ``name``."""
    allowed = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} ({value!r:.40})")
    number: Any = value  # (numbers.Real declares no __int__)
    if integer:
        return int(number)
    if finite and not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(number)
