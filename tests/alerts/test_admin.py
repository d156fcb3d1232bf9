"""Alerts through the CLI and the admin HTTP routes: the newest alerts with their delivery, a
delivery pass, and a sample sent to the webhook (signed like a real one, typed as a test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from spendguard.alerts import SIGNATURE_HEADER, verify
from spendguard.cli import main
from spendguard.limits import Period
from tests.admin_http.conftest import AUTH, PREFIX, build_app, make_settings
from tests.support import Gateway, lifespan
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.anyio

SECRET = "whsec-admin"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main([*args, "--json"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0 or captured.err, captured  # a failure says why
    return code, json.loads(out) if out.strip() else None


def test_alerts_test_sends_a_signed_sample(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    monkeypatch.setenv("SPENDGUARD_ALERT_WEBHOOK_SECRET", SECRET)
    assert cli(capsys, "alerts", "test")[0] == 2  # no webhook configured
    with WebhookReceiver() as receiver:
        monkeypatch.setenv("SPENDGUARD_ALERT_WEBHOOK_URL", receiver.url)
        code, out = cli(capsys, "alerts", "test")
        assert code == 0 and out["delivered"] is True
        receiver.status = 503
        code, out = cli(capsys, "alerts", "test")
        assert code == 1 and out == {**out, "delivered": False, "error": "HTTP 503"}
    [got] = receiver.taken
    assert got.json["type"] == "spendguard.test" and got.json["threshold_percent"] == 80
    assert verify(SECRET, got.headers[SIGNATURE_HEADER], got.body)


def test_alerts_ls_and_deliver_show_the_outbox(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gw = Gateway(tmp_path, alert_thresholds="50,100", alert_interval=3600)

    async def fire() -> None:
        async with gw:
            await gw.policy(Period.DAY, 30)
            for _ in range(2):
                assert (await gw.post()).status_code == 200
            assert await gw.guard.alerts.run_once() == (2, 2)  # no webhook: logged is delivered

    anyio.run(fire)
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", gw.settings.database_url.get_secret_value())
    code, out = cli(capsys, "alerts", "ls")
    assert code == 0
    assert [(a["threshold_percent"], a["used_micros"]) for a in out["alerts"]] == [
        (100, 30),
        (50, 15),
    ]
    assert all(a["delivered_at"] is not None and a["attempts"] == 1 for a in out["alerts"])
    assert cli(capsys, "alerts", "deliver") == (0, {"delivered": 0})
    assert main(["alerts", "ls", "--limit", "0"]) == 2


async def test_admin_routes_list_alerts_and_send_a_sample(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with WebhookReceiver() as receiver:
        settings = make_settings(
            tmp_path,
            "sqlite",
            request,
            alert_thresholds=(100,),
            alert_webhook_url=receiver.url,
            alert_webhook_secret=SECRET,
        )
        app = build_app(settings)
        transport = httpx.ASGITransport(app=app)
        async with lifespan(app), httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            put = await c.put(
                f"{PREFIX}/teams/acme/keys/alpha/policies/day",
                json={"limit_usd": "0.00003"},
                headers=AUTH,
            )
            assert put.status_code == 200
            for _ in range(2):
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": "unit-model", "messages": []},
                    headers={"x-test-team": "acme", "x-test-key": "alpha"},
                )
                assert r.status_code == 200
            guard = app.middleware_stack
            while not hasattr(guard, "guard"):
                guard = guard.app  # type: ignore[attr-defined]
            assert await guard.guard.alerts.run_once() == (1, 1)  # type: ignore[attr-defined]
            listed = (await c.get(f"{PREFIX}/alerts?limit=5", headers=AUTH)).json()["alerts"]
            assert [(a["threshold_percent"], a["attempts"]) for a in listed] == [(100, 1)]
            assert listed[0]["delivered_at"] is not None
            bad = await c.get(f"{PREFIX}/alerts?limit=x", headers=AUTH)
            assert bad.status_code == 400
            sample = await c.post(f"{PREFIX}/alerts/test", headers=AUTH)
            assert sample.status_code == 200 and sample.json()["delivered"] is True
    kinds = [d.json["type"] for d in receiver.taken]
    assert kinds == ["spendguard.threshold", "spendguard.test"]
    assert listed[0]["id"] == receiver.taken[0].headers["idempotency-key"]
