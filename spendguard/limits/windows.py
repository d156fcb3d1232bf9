"""Windows: the spans of time a limit counts usage over (design.md, "The limit model").

A :class:`Period` is a UTC calendar window: a day resets at 00:00 UTC, a month on the 1st at
00:00 UTC. Every period an inference lands in is decided by its start time ``t0``, so a call
started at 23:59:59 counts for that day however late it ends. Spend limits count in periods.

A :class:`Rolling` window is the last ``seconds``, counted in :data:`SLICES` slices: a slice
leaves the window as a whole once the window has moved past it, so usage drains slice by
slice and a 24h window always holds (about) the last 24 hours. Budgets count in them, and in
their calendar form too (``utc:day``, ``utc:month``: the period of ``t0``, as spend limits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import lru_cache
from typing import Final

from ..clock import as_utc


class Period(StrEnum):
    """A UTC calendar window. Its *bucket* is the id of the period containing a time."""

    DAY = "day"
    MONTH = "month"

    def bucket(self, t0: datetime) -> str:
        """``20260930`` for a day, ``202609`` for a month."""
        t = as_utc(t0)
        return t.strftime("%Y%m%d") if self is Period.DAY else t.strftime("%Y%m")

    def start(self, t0: datetime) -> datetime:
        t = as_utc(t0)
        if self is Period.DAY:
            return t.replace(hour=0, minute=0, second=0, microsecond=0)
        return t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)

    def end(self, t0: datetime) -> datetime:
        """The first instant that no longer belongs to ``t0``'s period."""
        start = self.start(t0)
        if self is Period.DAY:
            return start + timedelta(days=1)
        if start.month == 12:
            return start.replace(year=start.year + 1, month=1)
        return start.replace(month=start.month + 1)

    def seconds_to_reset(self, now: datetime) -> int:
        """Whole seconds until the period containing ``now`` resets (at least 1: Retry-After)."""
        return max(1, math.ceil((self.end(now) - as_utc(now)).total_seconds()))


SLICES: Final = 60
"""Slices of a rolling window: its usage drains by 1/60 of its length at a time."""


DAY_MS: Final = 86_400_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@lru_cache(maxsize=64)
def _month_days(day: int) -> tuple[int, int]:
    """The day indexes (days since the epoch) of the 1st of the month holding ``day`` and of
    the 1st of the next one."""
    t = _EPOCH + timedelta(days=day)
    first = (Period.MONTH.start(t) - _EPOCH).days
    return first, (Period.MONTH.end(t) - _EPOCH).days


@dataclass(frozen=True, slots=True)
class Rolling:
    """The last ``seconds`` (a whole number of minutes), cut into :data:`SLICES` slices; or,
    with ``calendar``, the current UTC day or month (``utc:day``, ``utc:month``), counted in
    slices of a day, all of which leave it at once when the period resets."""

    id: str  # the operator's name for it (``daily``), unique in its section
    period: str  # as configured (``24h``), for display
    seconds: int  # a calendar month: its longest (31 days), for how long keys live
    calendar: Period | None = None

    @property
    def period_ms(self) -> int:
        return self.seconds * 1000

    @property
    def slice_ms(self) -> int:
        if self.calendar is not None:
            return DAY_MS
        # Every period is a whole number of minutes, so a slice is a whole number of ms.
        return self.period_ms // SLICES

    @property
    def label(self) -> str:
        """What tells this window's series apart from another of the same id (a reload that
        changes the period starts afresh): its seconds, or its calendar period."""
        return str(self.seconds) if self.calendar is None else f"utc-{self.calendar.value}"

    def slice_of(self, now_ms: int) -> int:
        """The index of the slice ``now_ms`` falls in (usage lands in its request's)."""
        return now_ms // self.slice_ms

    def first_slice(self, now_ms: int) -> int:
        """The oldest slice still in the window at ``now_ms``."""
        if self.calendar is None:
            return now_ms // self.slice_ms - SLICES + 1
        day = now_ms // DAY_MS
        return day if self.calendar is Period.DAY else _month_days(day)[0]

    def reset_ms(self, now_ms: int) -> int:
        """When the window will have emptied if nothing more is counted: when the current
        slice (the newest) leaves it; a calendar window's at its reset."""
        if self.calendar is None:
            return (self.slice_of(now_ms) + SLICES) * self.slice_ms
        day = now_ms // DAY_MS
        return (day + 1 if self.calendar is Period.DAY else _month_days(day)[1]) * DAY_MS

    def epoch(self, now_ms: int) -> int:
        """Which length of the window ``now_ms`` is in (a threshold alerts once per epoch): a
        calendar window's period itself."""
        if self.calendar is None:
            return now_ms // self.period_ms
        return self.first_slice(now_ms)


PREPAID: Final = Rolling("prepaid", "prepaid", 60 * 2**32)
"""A prepaid account's window: one slice longer than anything counted (until 2106), so what
is counted never leaves it; only a top-up raises what it admits."""


# The windows a spend limit can have. Rolling windows join this union once the planner plans
# them beside calendar periods (today budgets plan their own); nothing that takes a
# ``Window`` should then need to know which kind it holds.
Window = Period
