"""Tests for spendguard.clock: aware UTC times, exact epoch microseconds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from spendguard.clock import as_utc, from_micros, to_micros, utcnow


def test_as_utc_converts_aware_times_and_refuses_naive_ones() -> None:
    t = datetime(2026, 10, 1, 1, 30, tzinfo=timezone(timedelta(hours=2)))
    assert as_utc(t) == datetime(2026, 9, 30, 23, 30, tzinfo=UTC)
    assert as_utc(t).tzinfo is UTC
    with pytest.raises(ValueError, match="naive"):
        as_utc(datetime(2026, 10, 1))


@pytest.mark.parametrize(
    "t",
    [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(2026, 9, 30, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
def test_epoch_microseconds_round_trip_exactly(t: datetime) -> None:
    assert from_micros(to_micros(t)) == t


def test_epoch_microseconds_are_exact_integers() -> None:
    assert to_micros(datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=UTC)) == 1_000_005
    # Far from the epoch a float timestamp would lose the last microsecond; this does not.
    t = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert to_micros(t) % 1_000_000 == 999_999
    assert to_micros(datetime(2026, 1, 1, 2, tzinfo=timezone(timedelta(hours=2)))) == to_micros(
        datetime(2026, 1, 1, tzinfo=UTC)
    )
    with pytest.raises(ValueError):
        to_micros(datetime(2026, 1, 1))


def test_utcnow_is_aware_utc() -> None:
    before = datetime.now(UTC)
    now = utcnow()
    assert now.tzinfo is UTC and before <= now <= datetime.now(UTC)
