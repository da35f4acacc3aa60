"""Checks of numbers users give agl (rewards, algorithm settings), shared so that each entry point refuses the
same values with the same words. Algorithms check their settings when built (so ``agl train --check`` finds a
bad one) rather than at their first update, where ``lr=inf`` or a NaN ``clip_eps`` would show up as NaN weights."""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    """An int or float that is a finite float (booleans are no numbers here). An int too large for a float
    (``--set lr=1000...0``) is not: torch would fail on it later, and ``math.isfinite`` raises OverflowError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_count(name: str, value: Any) -> None:
    """A count setting: a whole number >= 1 (``--set rounds=2.0`` and YAML/JSON configs give floats)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def check_number(name: str, value: Any, *, positive: bool) -> None:
    """A finite number, above 0 when ``positive``, else at least 0."""
    if not is_finite_number(value) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
