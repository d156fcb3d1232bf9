"""Time as spendguard keeps it: aware UTC datetimes, stored as exact epoch microseconds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def as_utc(t: datetime) -> datetime:
    if t.tzinfo is None:
        raise ValueError("naive datetime: spendguard needs an aware (UTC) time")
    return t.astimezone(UTC)


def to_micros(t: datetime) -> int:
    """Epoch microseconds: exact and portable across SQLite and PostgreSQL."""
    if t.tzinfo is None:
        raise ValueError("naive datetime: spendguard needs an aware (UTC) time")
    delta = t - _EPOCH  # aware minus aware: exact whatever t's zone, no conversion needed
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(us: int) -> datetime:
    # Positional: timedelta's keyword path costs twice as much, and a settlement makes one of
    # these per record. Integer microseconds are normalised exactly either way.
    return _EPOCH + timedelta(0, 0, us)


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_millis(t: datetime) -> int:
    """Epoch milliseconds (the rate windows' time, passed to the store scripts)."""
    return to_micros(t) // 1000


def time_text(at: datetime) -> str:
    """A time as RFC 3339 in UTC with a ``Z`` (``2026-12-02T00:00:00Z``): every JSON view's."""
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")
