"""Forecasts on an injected clock: the rate (the mean of the last hour's and the last day's),
the usage projected to the reset, and when the limit runs out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spendguard.engine.forecast import forecast
from spendguard.limits import Period
from tests.support import Gateway

pytestmark = pytest.mark.anyio

NOW = datetime(2026, 12, 3, 18, 0, tzinfo=UTC)
MIDNIGHT = datetime(2026, 12, 4, tzinfo=UTC)  # six hours away


def test_the_rate_is_the_mean_of_the_hour_and_the_day() -> None:
    # 600 in the last hour, 4,800 in the last 24 h: (600 + 200) / 2 = 400 per hour.
    f = forecast(1000, 5000, 600, 4800, NOW, MIDNIGHT)
    assert f.rate_per_hour == 400
    assert f.projected == 1000 + 6 * 400
    assert f.runs_out_at is None  # 3,400 by midnight: under 5,000


def test_it_runs_out_when_the_rate_reaches_the_limit_before_the_reset() -> None:
    f = forecast(1000, 2000, 600, 4800, NOW, MIDNIGHT)  # 1,000 left at 400 per hour
    assert f.runs_out_at == NOW + timedelta(hours=2, minutes=30)
    assert f.projected == 3400


def test_already_out_no_limit_and_no_spend() -> None:
    assert forecast(2000, 2000, 0, 0, NOW, MIDNIGHT).runs_out_at == NOW
    f = forecast(10, None, 3600, 0, NOW, MIDNIGHT)
    assert f.runs_out_at is None and f.projected == 10 + 6 * 1800
    quiet = forecast(10, 100, 0, 0, NOW, MIDNIGHT)
    assert (quiet.rate_per_hour, quiet.projected, quiet.runs_out_at) == (0, 10, None)


async def test_usage_reports_carry_the_forecast_of_each_limit(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await gw.policy(Period.DAY, 1000)
        await gw.policy(Period.MONTH, 100_000, key=None)
        start = gw.clock.now
        gw.clock.now = start - timedelta(hours=5)  # 10 requests five hours ago: the day's rate
        for _ in range(10):
            assert (await gw.post()).status_code == 200
        gw.clock.now = start - timedelta(minutes=30)  # 4 in the last hour
        for _ in range(4):
            assert (await gw.post()).status_code == 200
        gw.clock.now = start
        await gw.settle()
        report = await gw.guard.admin.usage("acme", "alpha")
    rows = {(r.limit.subject.api_key, r.limit.window): r for r in report.limits}
    day = rows["alpha", Period.DAY]
    f = day.forecast
    assert f is not None
    assert (f.last_hour, f.last_day) == (60, 210)  # 15 micro-USD each
    # (60 + 210 / 24) / 2 per hour, 12 hours to midnight (the clock is at noon)
    assert f.rate_per_hour == 35  # 34.375 rounded up
    assert f.projected == 210 + 413  # 34.375 * 12 = 412.5, rounded up
    assert f.runs_out_at is None
    team_month = rows[None, Period.MONTH].forecast
    assert team_month is not None and team_month.last_day == 210
