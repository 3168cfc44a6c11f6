"""Helpers the benchmarks share."""

from __future__ import annotations

import math


def pct(values: list[float], q: float) -> float:
    """The `q` quantile by nearest rank (the smallest value with at least `q` of them at or
    below it): p99 of 100 values is the 99th, not the largest. NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]
