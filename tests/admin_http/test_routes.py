"""Every admin route's happy path, on SQLite + the embedded store and on PostgreSQL + Redis:
the JSON it answers, what it changed in the ledger, and that a change applies to the very next
inference request (the route drops the cached policy, as the admin API does)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.limits import Period
from tests.admin_http.conftest import AdminGateway

pytestmark = pytest.mark.anyio


async def settle(gw: AdminGateway) -> None:
    guard = gw.middleware.guard
    assert guard is not None
    await guard.recorder.flush()
    await guard.worker.run_once()


def zulu(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


async def test_status_reports_the_lifespan_and_the_background_tasks(gw: AdminGateway) -> None:
    answer = await gw.admin("GET", "/status")
    assert answer.status_code == 200
    status = answer.json()
    assert status["enabled"] is True
    assert status["lifespan"] == "lifespan"
    assert status["running"] is True
    assert status["record_writer"]["running"] is True
    assert status["record_writer"]["pending"] == 0
    assert status["worker"]["running"] is True
    assert status["worker"]["settling"] is True
    assert status["ledger"]["connected"] is True
    assert status["budgets"] is False
    assert status["routes"]["configured"][0] == "/v1/chat/completions"
    assert status["routes"]["checked"] is True
    if gw.backend == "sqlite":
        assert status["store"] == {"mode": "embedded", "url": None, "shared": False}
    else:
        assert status["store"]["mode"] == "redis" and status["store"]["shared"] is True


async def test_config_is_the_effective_settings(gw: AdminGateway) -> None:
    answer = await gw.admin("GET", "/config")
    assert answer.status_code == 200
    config = answer.json()
    assert config["admin_token"] == "***"
    assert config["key_prefix"] == gw.settings.key_prefix
    assert config["settle_interval"] == 3600
    assert config["routes"] == list(gw.settings.routes)


async def test_policies_set_list_and_remove_apply_to_the_next_request(gw: AdminGateway) -> None:
    assert (await gw.chat()).status_code == 200  # the policy (none) is now cached
    put = await gw.admin("PUT", "/teams/acme/keys/alpha/policies/day", json={"limit_usd": "0"})
    assert put.status_code == 200
    assert put.json() == {
        "team": "acme",
        "api_key": "alpha",
        "period": "day",
        "limit_micros": 0,
        "limit_usd": "0.000000",
        "mode": "soft",
        "fit": False,
        "alert_at": None,
    }
    refused = await gw.chat()
    assert refused.status_code == 429  # at once: the cached policy was dropped
    assert (await gw.chat(key="beta")).status_code == 200  # another key is not limited

    team = await gw.admin(
        "PUT", "/teams/acme/policies/month", json={"limit_usd": "12.5", "mode": "hard"}
    )
    assert team.status_code == 200
    assert team.json()["limit_micros"] == 12_500_000
    assert team.json()["limit_usd"] == "12.500000"
    assert team.json()["mode"] == "hard"

    listed = (await gw.admin("GET", "/teams/acme/policies")).json()
    assert listed["team"] == "acme"
    assert {(p["api_key"], p["period"], p["limit_usd"], p["mode"]) for p in listed["policies"]} == {
        ("alpha", "day", "0.000000", "soft"),
        (None, "month", "12.500000", "hard"),
    }
    everyone = (await gw.admin("GET", "/policies")).json()["policies"]
    assert len(everyone) == 2
    assert (await gw.admin("GET", "/teams/other/policies")).json()["policies"] == []

    # The ledger has them (what the CLI would list).
    guard = gw.middleware.guard
    assert guard is not None
    stored = {(p.api_key_id, p.limit.window, p.amount) for p in await guard.admin.list_policies()}
    assert stored == {("alpha", Period.DAY, 0), (None, Period.MONTH, 12_500_000)}

    gone = await gw.admin("DELETE", "/teams/acme/keys/alpha/policies/day")
    assert gone.status_code == 200 and gone.json() == {"removed": True}
    assert (await gw.chat()).status_code == 200  # at once again
    again = await gw.admin("DELETE", "/teams/acme/keys/alpha/policies/day")
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"
    assert (await gw.admin("DELETE", "/teams/acme/policies/month")).status_code == 200
    assert (await gw.admin("GET", "/policies")).json() == {"policies": []}


async def test_usage_reports_used_remaining_and_reset_times(gw: AdminGateway) -> None:
    await gw.admin("PUT", "/teams/acme/policies/month", json={"limit_usd": "1"})
    await gw.admin("PUT", "/teams/acme/keys/alpha/policies/day", json={"limit_usd": "0.0001"})
    assert (await gw.chat()).status_code == 200  # 15 micro-USD on the unit price table
    assert (await gw.chat(key="beta")).status_code == 200
    await settle(gw)
    now = datetime.now(UTC)

    answer = await gw.admin("GET", "/teams/acme/usage")
    assert answer.status_code == 200
    usage = answer.json()
    assert usage["team"] == "acme" and usage["api_key"] is None
    assert usage["charges_total_micros"] == 30 and usage["charges_total_usd"] == "0.000030"
    assert usage["unsettled_records"] == 0
    rows = {(r["scope"], r["api_key"], r["period"]): r for r in usage["limits"]}
    month = rows[("team", None, "month")]
    assert month["used_micros"] == 30 and month["settled_usd"] == "0.000030"
    assert month["limit_usd"] == "1.000000"
    assert month["remaining_micros"] == 999_970 and month["remaining_usd"] == "0.999970"
    assert month["period_id"] == Period.MONTH.bucket(now)
    assert month["resets_at"] == zulu(Period.MONTH.end(now))
    day = rows[("api_key", "alpha", "day")]
    assert day["limit_micros"] == 100 and day["used_micros"] == 15
    assert day["remaining_micros"] == 85 and day["remaining_usd"] == "0.000085"
    assert day["resets_at"] == zulu(Period.DAY.end(now))
    # Spend without a limit shows too, with nothing remaining to compute.
    beta = rows[("api_key", "beta", "day")]
    assert beta["limit_micros"] is None and beta["remaining_micros"] is None
    if gw.backend == "postgres_redis":
        assert month["cache"] is not None and month["cache"]["settled_micros"] == 30

    only_alpha = (await gw.admin("GET", "/teams/acme/keys/alpha/usage")).json()
    assert only_alpha["api_key"] == "alpha"
    assert {r["api_key"] for r in only_alpha["limits"]} == {None, "alpha"}

    nobody = (await gw.admin("GET", "/teams/nobody/usage")).json()
    assert nobody["charges_total_micros"] == 0
    assert {(r["used_micros"], r["limit_micros"]) for r in nobody["limits"]} <= {(0, None)}


async def test_balance_topup_mode_and_show(gw: AdminGateway) -> None:
    none = await gw.admin("GET", "/teams/acme/balance")
    assert none.status_code == 404 and none.json()["error"]["code"] == "no_account"
    no_mode = await gw.admin("PUT", "/teams/acme/balance/mode", json={"mode": "hard"})
    assert no_mode.status_code == 404

    top = await gw.admin("POST", "/teams/acme/balance/topup", json={"usd": "0.000100"})
    assert top.status_code == 200
    assert top.json() == {
        "team": "acme",
        "mode": "soft",
        "topped_up_micros": 100,
        "topped_up_usd": "0.000100",
        "charged_micros": 0,
        "charged_usd": "0.000000",
        "balance_micros": 100,
        "balance_usd": "0.000100",
    }
    assert (await gw.chat()).status_code == 200
    await settle(gw)
    shown = (await gw.admin("GET", "/teams/acme/balance")).json()
    assert shown["charged_micros"] == 15 and shown["balance_usd"] == "0.000085"
    assert shown["remaining_micros"] == 85 and shown["unsettled_records"] == 0

    hard = await gw.admin("PUT", "/teams/acme/balance/mode", json={"mode": "hard"})
    assert hard.status_code == 200 and hard.json()["mode"] == "hard"
    assert (await gw.admin("GET", "/teams/acme/balance")).json()["mode"] == "hard"
    guard = gw.middleware.guard
    assert guard is not None
    report = await guard.admin.balance("acme")
    assert report is not None and report.account.hard and report.account.topped_up == 100

    # A balance used up refuses the next request (the top-up reached the cache at once).
    await gw.admin("PUT", "/teams/acme/balance/mode", json={"mode": "soft"})
    assert (await gw.chat(team="prepaid")).status_code == 200
    await gw.admin("POST", "/teams/prepaid/balance/topup", json={"usd": "0.000001"})
    assert (await gw.chat(team="prepaid")).status_code == 200  # soft: below, admitted
    await settle(gw)
    assert (await gw.chat(team="prepaid")).status_code == 429


async def test_model_lists_allow_list_and_remove(gw: AdminGateway) -> None:
    assert (await gw.admin("GET", "/teams/acme/models")).json() == {"team": "acme", "lists": {}}
    allowed = await gw.admin(
        "POST", "/teams/acme/keys/alpha/models/allow", json={"models": ["gpt-4o*"]}
    )
    assert allowed.status_code == 200
    assert allowed.json() == {"team": "acme", "lists": {"alpha": ["gpt-4o*"]}}
    assert (await gw.chat()).status_code == 403  # the unit model is not on alpha's list now
    assert (await gw.chat(key="beta")).status_code == 200
    team = await gw.admin("POST", "/teams/acme/models/allow", json={"models": ["x", "y*"]})
    assert team.json()["lists"] == {"alpha": ["gpt-4o*"], "": ["x", "y*"]}
    removed = await gw.admin(
        "POST", "/teams/acme/keys/alpha/models/remove", json={"models": ["gpt-4o*"]}
    )
    assert removed.status_code == 200 and removed.json()["lists"] == {"": ["x", "y*"]}
    listed = (await gw.admin("GET", "/teams/acme/models")).json()
    assert listed == {"team": "acme", "lists": {"": ["x", "y*"]}}


async def test_rates_set_list_and_remove(gw: AdminGateway) -> None:
    assert (await gw.admin("GET", "/teams/acme/rates")).json() == {"team": "acme", "rates": []}
    put = await gw.admin("PUT", "/teams/acme/keys/alpha/rates", json={"rpm": 1})
    assert put.status_code == 200
    assert put.json()["rates"] == [
        {"api_key": "alpha", "rpm": 1, "tpm": None, "max_parallel": None}
    ]
    # Applied from the next request: one request a minute for alpha, none for beta.
    assert (await gw.chat()).status_code == 200
    denied = await gw.chat()
    assert denied.status_code == 429
    assert denied.json()["error"]["code"] == "rate_limit_exceeded"
    assert denied.headers["x-ratelimit-limit-requests"] == "1"
    assert (await gw.chat(key="beta")).status_code == 200
    # A rate not given keeps its value; the team's own rates sit next to the key's.
    await gw.admin("PUT", "/teams/acme/keys/alpha/rates", json={"tpm": 50000})
    team = await gw.admin("PUT", "/teams/acme/rates/team", json={"max_parallel": 8})
    assert team.json()["rates"] == [
        {"api_key": None, "rpm": None, "tpm": None, "max_parallel": 8},
        {"api_key": "alpha", "rpm": 1, "tpm": 50000, "max_parallel": None},
    ]
    gone = await gw.admin("DELETE", "/teams/acme/keys/alpha/rates")
    assert gone.status_code == 200
    assert [r["api_key"] for r in gone.json()["rates"]] == [None]
    assert (await gw.chat()).status_code == 200  # alpha has no rate now
    again = await gw.admin("DELETE", "/teams/acme/keys/alpha/rates")
    assert again.status_code == 404


async def test_rates_refuse_bad_bodies(gw: AdminGateway) -> None:
    for body in ({}, {"rpm": "10"}, {"rpm": True}, {"rpm": -1}, {"burst": 3}, {"rpm": 10**20}):
        got = await gw.admin("PUT", "/teams/acme/rates/team", json=body)
        assert got.status_code == 400, body
    assert (await gw.admin("GET", "/teams/acme/rates")).json()["rates"] == []
