"""The CLI's ``--json`` and the admin routes answer the same views (``spendguard.engine.views``)
for the same data: usage, top spenders, balances, policies, rates, model lists and the budgets
report, key for key and in the same order. Both read the clock at the same instant here, so
even ``at`` agrees.

The one difference is where the data differs: the embedded store lives inside the gateway, out
of the CLI's reach, so on SQLite the CLI's rows have ``"cache": null`` where the route shows the
gateway's cache, and only settled usage is the same data to both (with Redis both read the same
cache, pending estimates included, and answer byte for byte the same)."""

from __future__ import annotations

import functools
import json
import re
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest

import spendguard.cli
from spendguard import Settings
from spendguard.cli import main
from spendguard.engine.admin import Admin
from tests.admin_http.conftest import AdminGateway
from tests.admin_http.test_routes import settle

pytestmark = pytest.mark.anyio

ZULU = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


def cli_env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """The CLI on the gateway's settings (read from the environment, as in production)."""
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", settings.database_url.get_secret_value())
    monkeypatch.setenv("SPENDGUARD_PRICES", str(settings.prices))
    monkeypatch.setenv("SPENDGUARD_KEY_PREFIX", settings.key_prefix)
    if settings.redis_url is not None:
        monkeypatch.setenv("SPENDGUARD_REDIS_URL", settings.redis_url.get_secret_value())
    if settings.budgets is not None:
        monkeypatch.setenv("SPENDGUARD_BUDGETS", json.dumps(settings.budgets))


async def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code = await anyio.to_thread.run_sync(lambda: main([*args, "--json"]))
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


async def http_json(gw: AdminGateway, method: str, path: str, **kwargs: Any) -> Any:
    answer = await gw.admin(method, path, **kwargs)
    assert answer.status_code == 200, answer.text
    return answer.json()


def same(cli: Any, http: Any) -> None:
    """Equal, with the keys in the same order (what a diff of the two outputs would see)."""
    assert json.dumps(cli) == json.dumps(http)


def without_cache(usage: dict[str, Any]) -> dict[str, Any]:
    return usage | {"limits": [row | {"cache": None} for row in usage["limits"]]}


async def test_cli_json_and_admin_routes_answer_the_same_views(
    gw: AdminGateway, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli_env(monkeypatch, gw.settings)
    # Policies: what the CLI sets, the route answers when it sets the same.
    cli_policy = await cli_json(
        capsys, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "1"
    )
    same(
        cli_policy,
        await http_json(gw, "PUT", "/teams/acme/policies/month", json={"limit_usd": "1"}),
    )
    await http_json(gw, "PUT", "/teams/acme/keys/alpha/policies/day", json={"limit_usd": "0.0001"})
    assert (await gw.chat()).status_code == 200  # 15 micro-USD on the unit price table
    assert (await gw.chat(key="beta")).status_code == 200
    await settle(gw)
    guard = gw.middleware.guard
    assert guard is not None
    shared = gw.backend == "postgres_redis"
    if shared:  # one record left unsettled: pending in the cache both read
        assert (await gw.chat(key="gamma")).status_code == 200
        await guard.recorder.flush()

    # One instant for both surfaces: the report's "at" (and each limit's reset) agree.
    at = datetime.now(UTC)
    monkeypatch.setattr(guard, "clock", lambda: at)
    monkeypatch.setattr(spendguard.cli, "Admin", functools.partial(Admin, clock=lambda: at))

    for args, path in [
        (("--team", "acme"), "/teams/acme/usage"),
        (("--team", "acme", "--api-key", "alpha"), "/teams/acme/keys/alpha/usage"),
    ]:
        cli = await cli_json(capsys, "usage", *args)
        http = await http_json(gw, "GET", path)
        assert ZULU.match(cli["at"]) and all(ZULU.match(r["resets_at"]) for r in cli["limits"])
        assert {r["api_key"] for r in cli["limits"]} >= {None, "alpha"}
        assert cli["unsettled_records"] == (1 if shared else 0)
        same(cli, http if shared else without_cache(http))

    for by in ("team", "key", "model"):
        cli = await cli_json(capsys, "top", "--by", by, "--period", "month")
        assert cli["spenders"] and cli["by"] == by
        same(cli, await http_json(gw, "GET", f"/top?by={by}&period=month"))
    teams = await http_json(gw, "GET", "/teams")
    assert teams["teams"] == [{"team": "acme", "spent_month_micros": 45 if shared else 30}]

    same(
        await cli_json(capsys, "policy", "ls", "--team", "acme"),
        await http_json(gw, "GET", "/teams/acme/policies"),
    )
    same(await cli_json(capsys, "policy", "ls"), await http_json(gw, "GET", "/policies"))

    topped = await cli_json(capsys, "balance", "topup", "--team", "acme", "--usd", "0.0001")
    same(topped, await http_json(gw, "PUT", "/teams/acme/balance/mode", json={"mode": "soft"}))
    assert (await gw.chat()).status_code == 200
    await settle(gw)
    same(
        await cli_json(capsys, "balance", "show", "--team", "acme"),
        await http_json(gw, "GET", "/teams/acme/balance"),
    )

    rates = await cli_json(capsys, "rate", "set", "--team", "acme", "--api-key", "k", "--rpm", "9")
    await http_json(gw, "PUT", "/teams/acme/rates/team", json={"max_parallel": 4})
    assert rates["rates"] == [{"api_key": "k", "rpm": 9, "tpm": None, "max_parallel": None}]
    same(
        await cli_json(capsys, "rate", "ls", "--team", "acme"),
        await http_json(gw, "GET", "/teams/acme/rates"),
    )
    same(
        await cli_json(capsys, "rate", "rm", "--team", "acme", "--api-key", "k"),
        await http_json(gw, "GET", "/teams/acme/rates"),
    )

    allowed = await cli_json(
        capsys, "models", "allow", "--team", "acme", "--api-key", "alpha", "gpt-4o*"
    )
    same(allowed, await http_json(gw, "GET", "/teams/acme/models"))
    same(
        await cli_json(capsys, "models", "ls", "--team", "acme"),
        await http_json(gw, "GET", "/teams/acme/models"),
    )


@pytest.mark.parametrize("backend", ["postgres_redis"])  # the CLI reaches counters on Redis only
async def test_cli_and_admin_routes_answer_the_same_budgets_report(
    bgw: AdminGateway, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli_env(monkeypatch, bgw.settings)
    assert (await bgw.chat(max_tokens=98)).status_code == 200
    report = await cli_json(capsys, "budgets", "inspect")
    assert report["counters"]
    same(report, await http_json(bgw, "GET", "/budgets"))
    reset = ("--scope", "per_api_key", "--team", "acme", "--api-key", "alpha")
    same(await cli_json(capsys, "budgets", "reset", *reset), {"reset": 1})
    same(await cli_json(capsys, "budgets", "inspect"), await http_json(bgw, "GET", "/budgets"))
