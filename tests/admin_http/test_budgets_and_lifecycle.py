"""The budget routes folded into the admin app (inspect and reset, on the embedded counters
and on Redis), and the status route through a gateway's life: not started, started lazily by
the first inference request (no lifespan), stopped."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from spendguard import Settings
from tests.admin_http.conftest import AUTH, PREFIX, AdminGateway, build_app
from tests.support import chat_body, write_unit_prices

pytestmark = pytest.mark.anyio


def tokens(report: dict[str, object], scope: str) -> int:
    counters = report["counters"]
    assert isinstance(counters, list)
    return sum(c["tokens"] for c in counters if c["scope"] == scope)


async def test_budgets_inspect_and_reset(bgw: AdminGateway) -> None:
    assert (await bgw.admin("GET", "/status")).json()["budgets"] is True
    assert (await bgw.chat(max_tokens=98)).status_code == 200
    report = (await bgw.admin("GET", "/budgets")).json()
    assert report["config"]["scopes"]["global"] == {"tokens": 1000}
    assert report["storage"] == ("memory" if bgw.backend == "sqlite" else "redis")
    assert tokens(report, "global") == 15 and tokens(report, "per_api_key") == 15

    bad = [
        {"scope": "nope"},
        {"scope": 1},
        {"scope": None},
        {"scope": "global", "window": "weekly"},
        {"scope": "global", "window": 3},
        {},
        {"scope": "global", "extra": 1},
        {"scope": "per_api_key", "team_id": "a\nb", "api_key_id": "k"},
        {"scope": "per_api_key", "team_id": "t" * 300, "api_key_id": "k"},
    ]
    for body in bad:
        answer = await bgw.admin("POST", "/budgets/reset", json=body)
        assert answer.status_code == 400, (body, answer.text)
    one = await bgw.admin(
        "POST",
        "/budgets/reset",
        json={"scope": "per_api_key", "team_id": "acme", "api_key_id": "alpha"},
    )
    assert one.status_code == 200 and one.json() == {"reset": 1}
    report = (await bgw.admin("GET", "/budgets")).json()
    assert tokens(report, "per_api_key") == 0 and tokens(report, "global") == 15
    fleet = await bgw.admin("POST", "/budgets/reset", json={"scope": "global"})
    assert fleet.json() == {"reset": 1}
    assert tokens((await bgw.admin("GET", "/budgets")).json(), "global") == 0


async def test_budget_routes_without_budgets(gw: AdminGateway) -> None:
    for method, path in (("GET", "/budgets"), ("POST", "/budgets/reset")):
        answer = await gw.admin(method, path, json={"scope": "global"})
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "no_budgets"


async def test_status_of_a_gateway_started_lazily(tmp_path: Path) -> None:
    """No lifespan (a mounted sub-app gets none): not started until the first inference
    request starts the background tasks."""
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        admin_token=AUTH["authorization"].removeprefix("Bearer "),
        prices=write_unit_prices(tmp_path),
    )
    app = build_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        before = (await c.get(PREFIX + "/status", headers=AUTH)).json()
        assert before["lifespan"] == "not_started" and before["running"] is False
        assert before["record_writer"]["running"] is False and before["worker"]["running"] is False
        # Admin routes work before anything started (the ledger connects on first use).
        await c.put(PREFIX + "/teams/acme/policies/day", json={"limit_usd": "1"}, headers=AUTH)
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        after = (await c.get(PREFIX + "/status", headers=AUTH)).json()
    assert after["lifespan"] == "first_request" and after["running"] is True
    assert after["record_writer"]["running"] is True and after["worker"]["running"] is True
    guard = AdminGateway(app, settings, c, "sqlite").middleware.guard
    assert guard is not None
    await guard.stop()
    assert not guard.recorder.running and not guard.worker.running


async def test_status_counts_records_not_yet_written(gw: AdminGateway) -> None:
    guard = gw.middleware.guard
    assert guard is not None
    # The ledger is slow for a moment: the writer holds the record.
    release = anyio.Event()
    real = guard.ledger.insert_records

    writing = anyio.Event()

    async def slow(*args: object, **kwargs: object) -> object:
        writing.set()
        await release.wait()
        return await real(*args, **kwargs)

    guard.ledger.insert_records = slow  # type: ignore[method-assign]
    try:
        assert (await gw.chat()).status_code == 200
        while not writing.is_set():  # the writer took the record and waits on the ledger
            await anyio.sleep(0.01)
        status = (await gw.admin("GET", "/status")).json()
        assert status["record_writer"]["pending"] == 1
    finally:
        release.set()
        guard.ledger.insert_records = real  # type: ignore[method-assign]
    await guard.recorder.flush()
    assert (await gw.admin("GET", "/status")).json()["record_writer"]["pending"] == 0
