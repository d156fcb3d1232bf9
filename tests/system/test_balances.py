"""Prepaid balances end to end through a gateway, on both stores: a balance runs out, a top-up
reopens it, the cache and the ledger agree."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from spendguard.clock import utcnow
from spendguard.ledger import Account
from spendguard.limits import Balance
from spendguard.money import micros_to_usd
from spendguard.store.redis import RedisStore
from tests.support import Gateway, chat_body, topups_total

pytestmark = pytest.mark.anyio

BALANCE_429 = {
    "error": {
        "type": "insufficient_quota",
        "code": "insufficient_quota",
        "message": "Account balance exhausted.",
    }
}


@pytest.fixture(params=["memory", "redis"])
async def gw(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Gateway]:
    if request.param == "memory":
        async with Gateway(tmp_path, utcnow) as gateway:
            yield gateway
    else:
        store = RedisStore.from_url(request.getfixturevalue("redis_url"), timeout=1.0)
        async with Gateway(tmp_path, utcnow, store=store) as gateway:
            yield gateway
        await store.aclose()


async def topup(gw: Gateway, micros: int, team: str = "acme") -> None:
    await gw.guard.admin.topup(team, micros_to_usd(micros))  # keeps the cache in sync itself


async def test_balance_runs_out_then_a_top_up_reopens_it(gw: Gateway) -> None:
    await topup(gw, 40)  # each request costs 15 micro-USD
    async with gw.client() as c:
        codes = [
            (await c.post("/v1/chat/completions", json=chat_body())).status_code for _ in range(4)
        ]
        assert codes == [200, 200, 200, 429]  # 40 -> 25 -> 10 -> -5: denied at <= 0
        denied = await c.post("/v1/chat/completions", json=chat_body())
        assert denied.json() == BALANCE_429
        assert "retry-after" not in denied.headers  # a balance has no reset time
        anthropic = await c.post("/v1/messages", json=chat_body(max_tokens=5))
        assert anthropic.json()["error"]["message"] == "Account balance exhausted."
        await gw.settle()
        account = await gw.guard.ledger.load_balance("acme")
        assert account == Account(
            "acme", 40, 45
        )  # overdrawn by the last admitted request (a soft cap)
        await topup(gw, 100)
        await gw.guard.worker.run_once()  # the sync pass raises the cached top-up total
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    await gw.settle()
    account = await gw.guard.ledger.load_balance("acme")
    assert account is not None
    assert account.topped_up == await topups_total(gw.guard.ledger.url, "acme") == 140
    assert account.charged == await gw.guard.ledger.charges_total("acme") == 60


async def test_teams_without_an_account_are_not_balance_limited(gw: Gateway) -> None:
    await topup(gw, 1, team="other")
    async with gw.client() as c:
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    await gw.settle()
    assert await gw.guard.ledger.load_balance("acme") is None


async def test_cached_balance_is_settled_plus_pending(gw: Gateway) -> None:
    await topup(gw, 1_000)
    async with gw.client() as c:
        for _ in range(2):
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    key = gw.guard.codec.usage_key(Balance("acme"), "")
    assert (await gw.store.read_usage([key]))[key] == 30  # pending estimates
    await gw.settle()
    assert (await gw.store.read_usage([key]))[key] == 30  # now settled charges, not doubled
    assert await gw.guard.ledger.load_balance("acme") == Account("acme", 1_000, 30)
