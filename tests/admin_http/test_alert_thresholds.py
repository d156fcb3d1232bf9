"""A limit's own alert thresholds through the HTTP admin routes, on the embedded store with
SQLite and on Redis with PostgreSQL: set, kept, listed, refused when malformed, and firing."""

from __future__ import annotations

from typing import Any

import pytest

from tests.admin_http.conftest import AdminGateway

pytestmark = pytest.mark.anyio

POLICY = "/teams/acme/keys/alpha/policies/day"


@pytest.mark.parametrize("bad", [[0], [1001], ["50"], [True], "50,80", {"at": 50}, [50.5]])
async def test_malformed_thresholds_are_a_400_naming_the_field(gw: AdminGateway, bad: Any) -> None:
    r = await gw.admin("PUT", POLICY, json={"limit_usd": "1", "alert_at": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert "alert" in r.json()["error"]["message"]
    listed = await gw.admin("GET", "/teams/acme/policies")
    assert listed.json()["policies"] == []  # nothing was saved


async def test_a_limit_alerts_at_its_own_thresholds(gw: AdminGateway) -> None:
    # The gateway has no default thresholds: only this limit's own can alert.
    r = await gw.admin("PUT", POLICY, json={"limit_usd": "0.00006", "alert_at": [80, 50]})
    assert r.status_code == 200 and r.json()["alert_at"] == [50, 80]
    r = await gw.admin("PUT", POLICY, json={"limit_usd": "0.00009"})  # absent: kept
    assert r.json()["alert_at"] == [50, 80] and r.json()["limit_micros"] == 90
    team = await gw.admin("PUT", "/teams/acme/policies/day", json={"limit_usd": "0.00006"})
    assert team.json()["alert_at"] is None  # the default, which is none here
    listed = (await gw.admin("GET", "/teams/acme/policies")).json()["policies"]
    assert sorted((p["api_key"] or "", p["alert_at"] or []) for p in listed) == [
        ("", []),
        ("alpha", [50, 80]),
    ]

    for _ in range(3):  # 15 micro-USD each: 45 is 50 % of the key's 90, 75 % of the team's
        assert (await gw.chat()).status_code == 200
    guard = gw.middleware.guard
    assert await guard.alerts.run_once() == (1, 1)
    alerts = (await gw.admin("GET", "/alerts")).json()["alerts"]
    assert [(a["api_key"], a["threshold_percent"], a["used_micros"]) for a in alerts] == [
        ("alpha", 50, 45)
    ]

    r = await gw.admin("PUT", POLICY, json={"limit_usd": "0.00009", "alert_at": None})
    assert r.json()["alert_at"] is None  # back to the default
    r = await gw.admin("PUT", POLICY, json={"limit_usd": "0.00009", "alert_at": []})
    assert r.json()["alert_at"] == []  # never alerts
