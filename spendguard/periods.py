"""UTC calendar periods. Every period an inference lands in is decided by its start time ``t0``.

A day limit resets at 00:00 UTC, a month limit on the 1st at 00:00 UTC (R8): not rolling windows.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from enum import StrEnum


class Period(StrEnum):
    DAY = "day"
    MONTH = "month"


def as_utc(t: datetime) -> datetime:
    if t.tzinfo is None:
        raise ValueError("naive datetime: spendguard periods need an aware (UTC) time")
    return t.astimezone(UTC)


def period_id(period: Period, t0: datetime) -> str:
    """``20260930`` for a day, ``202609`` for a month."""
    t = as_utc(t0)
    return t.strftime("%Y%m%d") if period is Period.DAY else t.strftime("%Y%m")


def period_start(period: Period, t0: datetime) -> datetime:
    t = as_utc(t0)
    if period is Period.DAY:
        return t.replace(hour=0, minute=0, second=0, microsecond=0)
    return t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def period_end(period: Period, t0: datetime) -> datetime:
    """The first instant that no longer belongs to ``t0``'s period."""
    start = period_start(period, t0)
    if period is Period.DAY:
        return start + timedelta(days=1)
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1)
    return start.replace(month=start.month + 1)


def seconds_to_reset(period: Period, now: datetime) -> int:
    """Whole seconds until the period containing ``now`` resets (at least 1, for Retry-After)."""
    return max(1, math.ceil((period_end(period, now) - as_utc(now)).total_seconds()))


def to_micros(t: datetime) -> int:
    """Epoch microseconds: exact and portable across SQLite and PostgreSQL."""
    delta = as_utc(t) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(us: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)


def utcnow() -> datetime:
    return datetime.now(UTC)
