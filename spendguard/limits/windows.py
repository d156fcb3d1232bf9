"""Windows: the spans of time a limit counts usage over (design.md, "The limit model").

A :class:`Period` is a UTC calendar window: a day resets at 00:00 UTC, a month on the 1st at
00:00 UTC. Every period an inference lands in is decided by its start time ``t0``, so a call
started at 23:59:59 counts for that day however late it ends. Spend limits count in periods.

A :class:`Rolling` window is the last ``seconds``, counted in :data:`SLICES` slices: a slice
leaves the window as a whole once the window has moved past it, so usage drains slice by
slice and a 24h window always holds (about) the last 24 hours. Budgets count in them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
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


@dataclass(frozen=True, slots=True)
class Rolling:
    """The last ``seconds`` (a whole number of minutes), cut into :data:`SLICES` slices."""

    id: str  # the operator's name for it (``daily``), unique in its section
    period: str  # as configured (``24h``), for display
    seconds: int

    @property
    def period_ms(self) -> int:
        return self.seconds * 1000

    @property
    def slice_ms(self) -> int:
        # Every period is a whole number of minutes, so a slice is a whole number of ms.
        return self.period_ms // SLICES

    def slice_of(self, now_ms: int) -> int:
        """The index of the slice ``now_ms`` falls in (usage lands in its request's)."""
        return now_ms // self.slice_ms

    def reset_ms(self, now_ms: int) -> int:
        """When the window will have emptied if nothing more is counted: when the current
        slice (the newest) leaves it."""
        return (self.slice_of(now_ms) + SLICES) * self.slice_ms


# The windows a spend limit can have. Rolling windows join this union once the planner plans
# them beside calendar periods (today budgets plan their own); nothing that takes a
# ``Window`` should then need to know which kind it holds.
Window = Period
