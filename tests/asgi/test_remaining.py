"""Remaining-spend headers (spendguard.asgi.remaining): the caller's own key limits only, from
the preflight's values, on the provider's answer and on spendguard's 429; off by default."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spendguard.asgi.remaining import remaining_headers
from spendguard.engine.decision import Decision, Verdict
from spendguard.identity import Identity
from spendguard.limits import Balance, KeyCodec, Period, Target, key_limit, team_limit
from spendguard.store import LimitState
from tests.support import Gateway

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
BETA = Identity("acme", "beta")
T0 = datetime(2026, 9, 30, 12, tzinfo=UTC)
CODEC = KeyCodec("quota", timedelta(days=2))


def state(target: Target, limit: int, used: int) -> LimitState:
    return LimitState(CODEC.check(target, T0), limit, used)


def test_only_the_callers_own_key_limits_are_told() -> None:
    decision = Decision(
        Verdict.ALLOW,
        ALPHA,
        T0,
        "r1",
        "r1",
        limits=(
            state(key_limit(ALPHA, Period.DAY), 5_000_000, 1_782_600),
            state(key_limit(ALPHA, Period.MONTH), 20_000_000, 21_000_000),  # over: shown as 0
            state(key_limit(BETA, Period.DAY), 1, 0),  # another key's (never in practice)
            state(team_limit(ALPHA, Period.DAY), 9, 1),
            state(Balance("acme"), 9, 1),
        ),
    )
    assert remaining_headers(decision) == [
        (b"x-spendguard-limit-usd-day", b"5.000000"),
        (b"x-spendguard-remaining-usd-day", b"3.217400"),
        (b"x-spendguard-reset-day", b"2026-10-01T00:00:00Z"),
        (b"x-spendguard-limit-usd-month", b"20.000000"),
        (b"x-spendguard-remaining-usd-month", b"0.000000"),
        (b"x-spendguard-reset-month", b"2026-10-01T00:00:00Z"),
    ]


def test_no_key_limit_no_headers() -> None:
    decision = Decision(
        Verdict.ALLOW, ALPHA, T0, "r1", "r1", limits=(state(team_limit(ALPHA, Period.DAY), 9, 1),)
    )
    assert remaining_headers(decision) == []


async def test_the_gateway_tells_the_remaining_budget_when_asked(tmp_path: Path) -> None:
    async with Gateway(tmp_path, remaining_headers=True) as gw:
        await gw.policy(Period.DAY, 30)
        await gw.policy(Period.MONTH, 1_000, key=None)  # the team's: not told
        first = await gw.post()  # 15 micro-USD
        second = await gw.post()
        denied = await gw.post()
    assert first.status_code == second.status_code == 200
    assert first.headers["x-spendguard-remaining-usd-day"] == "0.000030"  # before its charge
    assert second.headers["x-spendguard-remaining-usd-day"] == "0.000015"
    assert second.headers["x-spendguard-limit-usd-day"] == "0.000030"
    assert second.headers["x-spendguard-reset-day"] == "2026-10-01T00:00:00Z"
    assert "x-spendguard-remaining-usd-month" not in second.headers
    assert denied.status_code == 429
    assert denied.headers["x-spendguard-remaining-usd-day"] == "0.000000"
    assert denied.headers["x-should-retry"] == "false"


async def test_the_headers_are_off_by_default(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await gw.policy(Period.DAY, 15)
        ok, denied = await gw.post(), await gw.post()
    assert ok.status_code == 200 and denied.status_code == 429
    for response in (ok, denied):
        assert not [h for h in response.headers if h.startswith("x-spendguard-re")]
        assert not [h for h in response.headers if h.startswith("x-spendguard-limit")]
