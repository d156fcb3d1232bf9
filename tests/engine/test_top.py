"""Who is spending, without SQL: the top teams, keys and models of the current day or month,
each team and key with its limit, what is left, its reset and its forecast; the same through
the CLI and the admin HTTP routes."""

from __future__ import annotations

from pathlib import Path

import pytest

from spendguard.engine.views import top_json
from spendguard.limits import Period
from tests.support import Gateway, chat_body

pytestmark = pytest.mark.anyio


async def traffic(gw: Gateway) -> None:
    """acme/alpha 4 requests, acme/beta 2, zeta/z 3 (one of them another model's), at 15 each."""
    async with gw.client() as c:
        for team, key, n in (("acme", "alpha", 4), ("acme", "beta", 2), ("zeta", "z", 3)):
            for _ in range(n):
                r = await c.post(
                    "/v1/chat/completions",
                    json=chat_body(),
                    headers={"x-test-team": team, "x-test-key": key},
                )
                assert r.status_code == 200, r.text


async def test_top_teams_keys_and_models_with_limits_and_forecasts(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await gw.policy(Period.DAY, 1000)  # acme/alpha's day
        await gw.guard.admin.set_policy("zeta", None, window=Period.DAY, limit_usd="0.0001")
        await traffic(gw)
        async with gw.client() as c:  # one refused: zeta's key "y" has no model on its list
            await gw.guard.admin.allow_models("zeta", "y", ["gpt-*"])
            r = await c.post(
                "/v1/chat/completions",
                json=chat_body(),
                headers={"x-test-team": "zeta", "x-test-key": "y"},
            )
            assert r.status_code == 403
        await gw.guard.recorder.flush()
        await gw.guard.denials.flush()
        admin = gw.guard.admin
        teams = await admin.top_spenders("team", Period.DAY, 10)
        keys = await admin.top_spenders("key", Period.DAY, 2)
        models = await admin.top_spenders("model", Period.MONTH, 10)
    assert [(s.row.team_id, s.row.spent, s.row.requests) for s in teams.spenders] == [
        ("acme", 90, 6),
        ("zeta", 45, 3),
    ]
    acme, zeta = teams.spenders
    assert acme.amount is None and acme.remaining is None  # no team limit
    assert (zeta.amount, zeta.remaining) == (100, 55)
    assert (acme.denied_last_hour, zeta.denied_last_hour) == (0, 1)
    assert zeta.forecast is not None and zeta.forecast.last_hour == 45
    assert zeta.forecast.runs_out_at is not None  # 45 per hour: 55 left before midnight
    assert [(s.row.api_key_id, s.row.spent, s.amount) for s in keys.spenders] == [
        ("alpha", 60, 1000),
        ("z", 45, None),
    ]
    assert [(s.row.model, s.row.spent) for s in models.spenders] == [("unit-model", 135)]
    data = top_json(teams)
    assert data["by"] == "team" and data["period"] == "day" and data["period_id"] == "20260930"
    assert data["spenders"][1] | {"forecast": None} == {
        "team": "zeta",
        "api_key": None,
        "spent_micros": 45,
        "spent_usd": "0.000045",
        "requests": 3,
        "limit_micros": 100,
        "limit_usd": "0.000100",
        "remaining_micros": 55,
        "remaining_usd": "0.000055",
        "resets_at": "2026-10-01T00:00:00Z",
        "forecast": None,
        "denied_last_hour": 1,
    }


async def test_refused_requests_are_not_spend_but_recent_denials(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await gw.guard.admin.allow_models("acme", "beta", ["gpt-*"])
        await gw.policy(Period.DAY, 0)  # every request of acme/alpha refused
        assert (await gw.post()).status_code == 429
        assert (await gw.post()).status_code == 429
        async with gw.client() as c:
            r = await c.post(
                "/v1/chat/completions",
                json=chat_body(),
                headers={"x-test-team": "acme", "x-test-key": "beta"},
            )
            assert r.status_code == 403  # not on beta's model list
        await gw.guard.recorder.flush()
        assert await gw.guard.denials.flush() == 3
        assert await gw.guard.denials.flush() == 0  # written once
        denials = await gw.guard.admin.recent_denials(10)
        report = await gw.guard.admin.top_spenders("team", Period.DAY, 10)
        with pytest.raises(ValueError, match="by"):
            await gw.guard.admin.top_spenders("nobody", Period.DAY, 10)
        with pytest.raises(ValueError, match="limit"):
            await gw.guard.admin.top_spenders("team", Period.DAY, 0)
    assert report.spenders == ()
    assert [(d.api_key_id, d.kind, d.model) for d in denials] == [
        ("beta", "model", "unit-model"),
        ("alpha", "api_key:day", "unit-model"),
        ("alpha", "api_key:day", "unit-model"),
    ]
