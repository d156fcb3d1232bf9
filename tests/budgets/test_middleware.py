"""Budgets through the whole middleware: 429 bodies and Retry-After, the key's headers, the
hold replaced by the actual usage once (buffered, streamed) or returned (upstream error,
cancellation, a spend-limit refusal), per-key budgets from the ledger, storage outages.

A chat request with ``max_tokens=98`` and the prompt "hi" is estimated at 2 + 98 = 100 tokens
(100 micro-USD on the unit-priced model); the fake upstream reports 10 + 5 = 15 used.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client import REGISTRY

from spendguard.asgi import admin_app
from spendguard.engine.budgets import BudgetGate
from spendguard.limits import Period
from spendguard.testing import StreamingASGITransport, fake_upstream
from tests.support import Counting, chat_body
from tests.support.budgets import BudgetGateway, section

pytestmark = pytest.mark.anyio

EST = 100  # tokens reserved by a request with max_tokens=98
USED = 15  # what the fake upstream reports


def req(**extra: Any) -> dict[str, Any]:
    return chat_body(**{"max_tokens": 98, **extra})


async def counters(gate: BudgetGate, gw: BudgetGateway) -> dict[tuple[str, str, str], int]:
    report = await gw.budgets.inspect()
    return {(c.scope.value, c.subject, c.window): c.tokens for c in report.counters}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_key_budget_denies_with_details_and_retry_after(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 250}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        for _ in range(2):
            assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        gw.clock.now += timedelta(minutes=1)
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        # 45 used: an estimate of 205 fits exactly (and then uses 15 like the others).
        assert (await c.post("/v1/chat/completions", json=req(max_tokens=203))).status_code == 200
        gw.clock.now += timedelta(minutes=1)
        denied = await c.post("/v1/chat/completions", json=req(max_tokens=198))
    assert denied.status_code == 429
    assert denied.json() == {
        "error": {
            "type": "budget_exceeded",
            "code": "budget_exceeded",
            "message": "API key token budget exceeded for window 'hourly'.",
            "details": {"scope": "per_api_key", "window": "hourly", "unit": "tokens", "limit": 250},
        }
    }
    # 60 used, 200 wanted: the first minute's 30 tokens leave the hour 58 minutes from now,
    # which is enough (10 must go).
    assert denied.headers["retry-after"] == str(58 * 60)
    assert "x-budget-api-key-limit" not in denied.headers


async def test_anthropic_routes_get_the_rate_limit_envelope(tmp_path: Path) -> None:
    budgets = section(scopes={"per_model": {"unit-model": {"cost_usd": 0.00011}}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        denied = await c.post("/v1/messages", json=req())  # 15 used + 100 held > 110
    assert denied.status_code == 429
    body = denied.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert body["error"]["details"] == {
        "scope": "per_model",
        "window": "hourly",
        "unit": "cost_micro_usd",
        "limit_micro_usd": 110,
        "model": "unit-model",
    }
    # The 15 used a moment ago must leave the window: the whole hour.
    assert denied.headers["retry-after"] == "3600"


async def test_order_is_window_then_key_model_global(tmp_path: Path) -> None:
    budgets = section(
        scopes={
            "per_api_key": {"tokens": 10},  # denies too, but in a later window
            "global": {"tokens": 50},
        },
        windows=[{"id": "daily", "period": "24h"}, {"id": "hourly", "period": "1h"}],
    )
    budgets["scopes"]["per_api_key"] = None
    budgets["scopes"]["per_model"] = {"unit-model": {"tokens": 60}}
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        denied = await c.post("/v1/chat/completions", json=req())
        details = denied.json()["error"]["details"]
        assert (details["scope"], details["window"]) == ("per_model", "daily")
        # Nothing of the denied request stays reserved anywhere.
        assert set((await counters(gw.gate, gw)).values()) == {0}


async def test_headers_report_the_key_level_after_this_reservation(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1000}, "global": {"tokens": 10**6}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        first = await c.post("/v1/chat/completions", json=req())
        second = await c.post("/v1/chat/completions", json=req())
    assert first.headers["x-budget-api-key-limit"] == "1000"
    assert first.headers["x-budget-api-key-remaining"] == str(1000 - EST)
    # The first request's hold was replaced by its 15 tokens.
    assert second.headers["x-budget-api-key-remaining"] == str(1000 - USED - EST)
    now = int(gw.clock.now.timestamp())
    assert int(second.headers["x-budget-api-key-reset"]) == now + 3600  # the hourly window


@pytest.mark.parametrize(
    "scopes",
    [
        {"per_api_key": {"cost_usd": 1}},  # cost only: no token numbers to report
        {"global": {"tokens": 10**6}},  # shared scopes never report
        {"per_model": {"other-model": {"tokens": 5}}},  # nothing applies to this request
    ],
)
async def test_no_headers_without_a_key_token_limit(tmp_path: Path, scopes: Any) -> None:
    async with BudgetGateway(tmp_path, budgets=section(scopes=scopes)) as gw, gw.client() as c:
        ok = await c.post("/v1/chat/completions", json=req())
    assert ok.status_code == 200
    assert not [h for h in ok.headers if h.startswith("x-budget")]


async def test_disabled_is_a_strict_no_op(tmp_path: Path) -> None:
    budgets = section(enabled=False, scopes={"per_api_key": {"tokens": 1}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        ok = await c.post("/v1/chat/completions", json=req())
        assert ok.status_code == 200
        assert not [h for h in ok.headers if h.startswith("x-budget")]
        assert (await gw.budgets.inspect()).counters == ()  # no counters were made


async def test_streaming_usage_replaces_the_hold_once(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1000}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        body = req(stream=True, stream_options={"include_usage": True})
        ok = await c.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200 and "[DONE]" in ok.text
        assert (await counters(gw.gate, gw))[("per_api_key", "acme:alpha", "hourly")] == USED


async def test_upstream_error_returns_the_reservation(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1000}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        failed = await c.post("/v1/chat/completions", json=req(x_status=500))
        assert failed.status_code == 500
        assert (await counters(gw.gate, gw))[("per_api_key", "acme:alpha", "hourly")] == 0


@pytest.mark.parametrize(("stream", "counted"), [(False, 0), (True, 2)])
async def test_a_cancelled_client_returns_the_reservation(
    tmp_path: Path, stream: bool, counted: int
) -> None:
    """The client gives up while the upstream stalls: the 100-token hold is returned. Before
    any response nothing is counted; a stream that had started counts what spend limits charge
    for it (the prompt's 2 tokens, nothing served)."""
    budgets = section(scopes={"per_api_key": {"tokens": 1000}})
    # A non-streaming request to this upstream never gets a response.
    app = None if stream else fake_upstream(stall_after=0)
    async with BudgetGateway(tmp_path, budgets=budgets, app=app) as gw:
        transport = StreamingASGITransport(gw.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            with anyio.move_on_after(0.5):
                body = req(stream=True, x_stall_at=0) if stream else req()
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass
        for _ in range(50):  # the cancelled request finishes in the background
            report = await counters(gw.gate, gw)
            if report[("per_api_key", "acme:alpha", "hourly")] < 100:
                break
            await anyio.sleep(0.02)
        assert report[("per_api_key", "acme:alpha", "hourly")] == counted


async def test_a_spend_limit_refusal_returns_the_budget_hold(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1000}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        await gw.policy(Period.DAY, 0)  # spend limit $0: everything blocked
        refused = await c.post("/v1/chat/completions", json=req())
        assert refused.json()["error"]["code"] == "spend_limit_exceeded"
        assert (await counters(gw.gate, gw))[("per_api_key", "acme:alpha", "hourly")] == 0


async def test_a_key_budget_replaces_the_fleet_default(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 10**6}, "global": {"tokens": 10**6}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        await gw.budgets.set_key_budget("acme", "alpha", max_tokens=150, budget_window="2h")
        ok = await c.post("/v1/chat/completions", json=req())
        assert ok.status_code == 200
        assert "x-budget-api-key-limit" not in ok.headers  # the key's own budget: deny only
        denied = await c.post("/v1/chat/completions", json=req(max_tokens=148))  # 15 + 150
        assert denied.json()["error"]["details"] == {
            "scope": "per_api_key",
            "window": "2h",
            "unit": "tokens",
            "limit": 150,
        }
        seen = await counters(gw.gate, gw)
        # Charged against its own window only, never the fleet default; global still counts.
        assert seen[("per_api_key", "acme:alpha", "2h")] == USED
        assert seen[("global", "", "hourly")] == USED
        assert ("per_api_key", "acme:alpha", "hourly") not in seen
        # Another key follows the default.
        async with gw.client() as c2:
            other = await c2.post(
                "/v1/chat/completions", json=req(), headers={"x-test-key": "beta"}
            )
        assert other.headers["x-budget-api-key-limit"] == str(10**6)
        assert await gw.budgets.remove_key_budget("acme", "alpha")
        back = await c.post("/v1/chat/completions", json=req())
        assert back.headers["x-budget-api-key-limit"] == str(10**6)


async def test_reset_clears_one_key(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 110}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 429
        assert await gw.budgets.reset("per_api_key", team_id="acme", api_key_id="alpha") == 1
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200


async def test_store_outage_fails_open_into_the_local_tracker(tmp_path: Path) -> None:
    budgets = section(storage="redis", scopes={"per_api_key": {"tokens": 150}})
    before = metric("spendguard_budget_storage_unavailable_total", action="fallback")
    async with (
        BudgetGateway(
            tmp_path, budgets=budgets, redis_url="redis://127.0.0.1:1", redis_timeout=0.2
        ) as gw,
        gw.client() as c,
    ):
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        # Still enforced, by this replica's tracker: 15 + 100 fits, 15 + 15 + 100... no.
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        assert (await c.post("/v1/chat/completions", json=req(max_tokens=120))).status_code == 429
    after = metric("spendguard_budget_storage_unavailable_total", action="fallback")
    assert after - before == 3


async def test_store_outage_fails_closed_with_503(tmp_path: Path) -> None:
    budgets = section(storage="redis", fail_open=False, scopes={"global": {"tokens": 150}})
    before = metric("spendguard_budget_storage_unavailable_total", action="refused")
    async with (
        BudgetGateway(
            tmp_path, budgets=budgets, redis_url="redis://127.0.0.1:1", redis_timeout=0.2
        ) as gw,
        gw.client() as c,
    ):
        refused = await c.post("/v1/messages", json=req())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["type"] == "overloaded_error"
    assert metric("spendguard_budget_storage_unavailable_total", action="refused") == before + 1


async def test_a_full_tracker_refuses_rather_than_admit_untracked(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 10**6}})
    async with BudgetGateway(tmp_path, budgets=budgets, memory_max_keys=1) as gw, gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        other = await c.post("/v1/chat/completions", json=req(), headers={"x-test-key": "beta"})
    assert other.status_code == 429
    assert other.json()["error"]["details"]["scope"] == "per_api_key"


async def test_metrics_count_rejections_and_usage(tmp_path: Path) -> None:
    budgets = section(scopes={"global": {"tokens": 110}})
    labels = {"scope": "global", "window": "hourly"}
    rejected = metric("spendguard_budget_rejections_total", **labels)
    used = metric("spendguard_budget_used_total", **labels, unit="tokens")
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        await c.post("/v1/chat/completions", json=req())
        await c.post("/v1/chat/completions", json=req())
    assert metric("spendguard_budget_rejections_total", **labels) == rejected + 1
    assert metric("spendguard_budget_used_total", **labels, unit="tokens") == used + USED


async def test_budgets_file_hot_reload(tmp_path: Path) -> None:
    path = tmp_path / "budgets.yaml"
    path.write_text("enabled: false\n")
    async with BudgetGateway(tmp_path, budgets_file=path) as gw, gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        # Enabling the section applies from the next request after it is noticed.
        path.write_text(
            "enabled: true\nwindows: [{id: hourly, period: 1h}]\n"
            "scopes: {per_api_key: {tokens: 50}}\n"
        )
        assert gw.gate.source.reload()
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 429
        # An invalid edit is refused; the previous section stays in force.
        path.write_text(
            "enabled: true\nwindows: [{id: hourly, period: 1h}]\n"
            "scopes: {per_api_key: {tokens: 0}}\n"
        )
        assert not gw.gate.source.reload()
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 429
        # Widening the limit applies at once.
        path.write_text(
            "enabled: true\nwindows: [{id: hourly, period: 1h}]\n"
            "scopes: {per_api_key: {tokens: 5000}}\n"
        )
        assert gw.gate.source.reload()
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        # Left to the requests themselves: noticed within about a second.
        path.write_text(
            "enabled: true\nwindows: [{id: hourly, period: 1h}]\n"
            "scopes: {per_api_key: {tokens: 60}}\n"
        )
        await anyio.sleep(1.1)
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 429


async def test_admin_routes_inspect_and_reset(tmp_path: Path) -> None:
    budgets = section(scopes={"global": {"tokens": 110}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        # The admin app's budget routes (docs/admin-http.md), behind its bearer token.
        admin = admin_app(gw.guard, token="s3cret", budgets=gw.gate)
        auth = {"authorization": "Bearer s3cret"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin), base_url="http://admin"
        ) as a:
            assert (await a.get("/budgets")).status_code == 401
            await c.post("/v1/chat/completions", json=req())
            report = (await a.get("/budgets", headers=auth)).json()
            assert report["config"]["scopes"]["global"] == {"tokens": 110}
            assert {"scope": "global", "window": "hourly", "tokens": USED}.items() <= next(
                r for r in report["counters"] if r["window"] == "hourly"
            ).items()
            assert (await c.post("/v1/chat/completions", json=req())).status_code == 429
            bad = await a.post("/budgets/reset", headers=auth, json={"scope": "nope"})
            assert bad.status_code == 400
            done = await a.post("/budgets/reset", headers=auth, json={"scope": "global"})
            assert done.json() == {"reset": 1}
            assert (await c.post("/v1/chat/completions", json=req())).status_code == 200


async def test_redis_storage_without_a_redis_url_counts_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    budgets = section(storage="redis", scopes={"per_api_key": {"tokens": 110}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 429
        assert (await gw.budgets.inspect()).storage == "memory"
    assert "no Redis URL is set: counting in memory" in caplog.text


async def test_headers_report_the_tightest_window(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1000}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        await c.post("/v1/chat/completions", json=req())
        gw.clock.now += timedelta(minutes=61)  # the hour has drained, the day has not
        ok = await c.post("/v1/chat/completions", json=req())
    assert ok.headers["x-budget-api-key-remaining"] == str(1000 - USED - EST)
    # The daily window empties when its current 24-minute slice has left it.
    slice_start = int(gw.clock.now.timestamp()) // 1440 * 1440
    assert int(ok.headers["x-budget-api-key-reset"]) == slice_start + 86_400


async def test_a_budgeted_request_body_is_parsed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Budgets hold every request's input estimate at admission: the gateway takes it from
    the parse that validated the body instead of decoding the body a second time."""
    from spendguard.asgi import request as parsing

    parses = Counting(parsing)
    monkeypatch.setattr(parsing, "_load", parses._load)
    budgets = section(scopes={"per_api_key": {"tokens": 10_000}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        answer = await c.post("/v1/chat/completions", json=req())
        held = await counters(gw.gate, gw)
    assert answer.status_code == 200
    assert parses.calls["_load"] == 1
    assert sorted(set(held.values())) == [USED], held  # its estimate held, then replaced
