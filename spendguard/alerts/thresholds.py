"""Which amounts of a limit alert: percentages of it, as the store is asked to check them."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ..limits.percentages import MAX_PERCENT, parse_thresholds
from ..store import AlertMarks, LimitState

__all__ = ["MAX_PERCENT", "amount_at", "marks_for", "parse_thresholds", "stored_thresholds"]


def amount_at(limit: int, percent: int) -> int:
    """The usage (micro-USD) at which ``percent`` of ``limit`` is reached, rounded up: an alert
    at 80 % of 1 micro-USD fires at 1."""
    return -(-limit * percent // 100)


@lru_cache(maxsize=4096)
def _marks(limit: int, thresholds: tuple[int, ...]) -> tuple[int, tuple[tuple[int, int], ...]]:
    # Made once per limit amount, not per request (the same object each time: the Redis store
    # keeps its wire text by it too).
    return limit, tuple((p, amount_at(limit, p)) for p in thresholds)


@lru_cache(maxsize=1024)
def stored_thresholds(text: str) -> tuple[int, ...]:
    """A limit's own thresholds as its policy stores them (``"50,80"``; ``""``: none). A
    value that is not one (written by hand) alerts at nothing rather than failing a request."""
    try:
        return parse_thresholds(text)
    except ValueError:
        return ()


def marks_for(
    alerts_key: str, limits: Sequence[LimitState], thresholds: tuple[int, ...]
) -> AlertMarks | None:
    """What a postflight charging ``limits`` asks its store to check, or None when nothing
    can alert. ``thresholds`` are the gateway's default; a limit with its own (``alert_at``)
    alerts at those instead."""
    marks: list[tuple[int, tuple[tuple[int, int], ...]] | None] = []
    any_mark = False
    for state in limits:
        own = state.alert_at
        wanted = thresholds if own is None else stored_thresholds(own)
        # A balance's limit is what was topped up: its thresholds are shares of it used, and
        # a top-up (a new amount) arms them again.
        if not wanted or state.limit <= 0:
            marks.append(None)
            continue
        marks.append(_marks(state.limit, wanted))
        any_mark = True
    return AlertMarks(alerts_key, marks) if any_mark else None
