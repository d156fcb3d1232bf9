"""Windows: the spans of time a limit counts spend over (design.md, "The limit model").

Today every window is a UTC calendar period: a day resets at 00:00 UTC, a month on the 1st at
00:00 UTC. They are not rolling windows. Every window an inference lands in is decided by its
start time ``t0``, so a call started at 23:59:59 counts for that day however late it ends.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from enum import StrEnum

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


# The windows a limit can have. Rolling durations join this union as a second class with the
# same four methods; nothing that takes a ``Window`` needs to know which kind it holds.
Window = Period
