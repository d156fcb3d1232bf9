"""Tests for spendguard.limits.windows: UTC calendar periods, their buckets, ends and resets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from spendguard.limits import Period
from spendguard.limits.windows import SLICES, Rolling

PLUS_2 = timezone(timedelta(hours=2))


def test_periods_are_utc_calendar_periods() -> None:
    t = datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert Period.DAY.bucket(t) == "20261231" and Period.MONTH.bucket(t) == "202612"
    assert Period.MONTH.end(t) == datetime(2027, 1, 1, tzinfo=UTC)
    assert Period.DAY.seconds_to_reset(t) == 1
    with pytest.raises(ValueError):
        Period.DAY.bucket(datetime(2026, 1, 1))  # naive: ambiguous, refused


def test_buckets_are_taken_in_utc_whatever_the_offset() -> None:
    # 01:00 on Oct 1st at +02:00 is still Sep 30th in UTC.
    t = datetime(2026, 10, 1, 1, 0, tzinfo=PLUS_2)
    assert (Period.DAY.bucket(t), Period.MONTH.bucket(t)) == ("20260930", "202609")
    assert Period.DAY.start(t) == datetime(2026, 9, 30, tzinfo=UTC)
    assert Period.DAY.end(t) == datetime(2026, 10, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("period", "t", "start", "end"),
    [
        # A day at a month end and at a year end.
        (Period.DAY, datetime(2026, 9, 30, 12, tzinfo=UTC), (2026, 9, 30), (2026, 10, 1)),
        (Period.DAY, datetime(2026, 12, 31, 23, 59, tzinfo=UTC), (2026, 12, 31), (2027, 1, 1)),
        # A month: 30 and 31 days, February in a leap year, December into the next year.
        (Period.MONTH, datetime(2026, 9, 1, tzinfo=UTC), (2026, 9, 1), (2026, 10, 1)),
        (Period.MONTH, datetime(2026, 10, 31, 23, tzinfo=UTC), (2026, 10, 1), (2026, 11, 1)),
        (Period.MONTH, datetime(2028, 2, 29, 12, tzinfo=UTC), (2028, 2, 1), (2028, 3, 1)),
        (Period.MONTH, datetime(2026, 12, 15, tzinfo=UTC), (2026, 12, 1), (2027, 1, 1)),
    ],
)
def test_start_and_end_at_month_and_year_edges(
    period: Period, t: datetime, start: tuple[int, int, int], end: tuple[int, int, int]
) -> None:
    assert period.start(t) == datetime(*start, tzinfo=UTC)
    assert period.end(t) == datetime(*end, tzinfo=UTC)
    assert period.start(t) <= t < period.end(t)
    # The end is the first instant of the next period: it has the next bucket.
    assert period.bucket(period.end(t)) != period.bucket(t)
    assert period.bucket(period.end(t) - timedelta(microseconds=1)) == period.bucket(t)


def test_buckets_of_a_day_and_a_month() -> None:
    t = datetime(2026, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert Period.DAY.bucket(t) == "20260203" and Period.MONTH.bucket(t) == "202602"


@pytest.mark.parametrize(
    ("period", "now", "seconds"),
    [
        (Period.DAY, datetime(2026, 9, 30, tzinfo=UTC), 86_400),  # a whole day at its start
        (Period.DAY, datetime(2026, 9, 30, 12, tzinfo=UTC), 43_200),
        (Period.DAY, datetime(2026, 9, 30, 23, 59, 58, 1, tzinfo=UTC), 2),  # rounded up
        (Period.DAY, datetime(2026, 9, 30, 23, 59, 59, 999999, tzinfo=UTC), 1),  # never 0
        (Period.MONTH, datetime(2026, 9, 30, 12, tzinfo=UTC), 43_200),
        (Period.MONTH, datetime(2026, 2, 1, tzinfo=UTC), 28 * 86_400),
    ],
)
def test_seconds_to_reset_is_whole_and_at_least_one(
    period: Period, now: datetime, seconds: int
) -> None:
    assert period.seconds_to_reset(now) == seconds


@pytest.mark.parametrize("method", ["bucket", "start", "end", "seconds_to_reset"])
@pytest.mark.parametrize("period", list(Period))
def test_a_naive_datetime_is_refused_everywhere(period: Period, method: str) -> None:
    with pytest.raises(ValueError, match="naive"):
        getattr(period, method)(datetime(2026, 9, 30, 12))


def test_period_names_are_the_ledger_and_cli_spellings() -> None:
    assert [p.value for p in Period] == ["day", "month"]
    assert Period("month") is Period.MONTH


def test_a_rolling_window_drains_by_sixtieths() -> None:
    day = Rolling("daily", "24h", 86_400)
    assert SLICES == 60 and day.slice_ms == 1_440_000  # 24 minutes
    t = 1_800_000_000_000  # a slice boundary
    assert day.slice_of(t) == day.slice_of(t + day.slice_ms - 1) == day.slice_of(t - 1) + 1
    # Empty (if nothing more is counted) once the newest slice, the one of now, has left it.
    assert day.reset_ms(t) == t + day.period_ms
    assert day.reset_ms(t + day.slice_ms - 1) == t + day.period_ms


def test_budget_scopes_are_subjects_of_the_limit_model() -> None:
    from spendguard.budgets import Scope
    from spendguard.limits import SubjectKind

    assert {s: s.kind for s in Scope} == {
        Scope.PER_API_KEY: SubjectKind.API_KEY,
        Scope.PER_END_USER: SubjectKind.END_USER,
        Scope.PER_TAG: SubjectKind.TAG,
        Scope.PER_CUSTOMER: SubjectKind.CUSTOMER,
        Scope.PER_MODEL: SubjectKind.MODEL,
        Scope.GLOBAL: SubjectKind.FLEET,
    }
