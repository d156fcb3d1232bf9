"""Percentiles and the min/median/max summary every reported figure goes through."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest-rank on sorted data: a value that was measured."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def summary(values: Sequence[float]) -> dict[str, float]:
    """min / median / max over the repeats of one figure."""
    if not values:
        raise ValueError("no values")
    return {
        "min": float(min(values)),
        "median": float(statistics.median(values)),
        "max": float(max(values)),
    }
