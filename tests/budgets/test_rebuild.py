"""After a Redis restart (no persistence: every counter is gone) a bucket is rebuilt from the
ledger's records on its next use instead of starting from zero; a reset is not undone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import RedisServer, chat_body
from tests.support.budgets import BudgetGateway, section

pytestmark = pytest.mark.anyio

USED = 15  # per request, as the fake upstream reports it


def req(reserve: int = 100) -> dict[str, object]:
    return chat_body(max_tokens=reserve - 2)  # the prompt is 2 tokens


async def test_counters_survive_a_redis_restart(tmp_path: Path, redis_server: RedisServer) -> None:
    budgets = section(
        storage="redis",
        scopes={
            "per_api_key": {"tokens": 129},
            "per_model": {"unit-model": {"tokens": 10**6}},
            # The daily window also counts requests: rebuilt from the records' count.
            "global": {"tokens": 10**6, "windows": {"daily": {"requests": 4}}},
        },
    )
    gw = BudgetGateway(tmp_path, budgets=budgets, redis_url=redis_server.url, redis_timeout=2.0)
    async with gw, gw.client() as c:
        for _ in range(2):
            assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 429
        await gw.guard.recorder.flush()  # the records are in the ledger
        redis_server.kill()
        redis_server.restart()
        # From zero 110 would fit; with the 30 tokens rebuilt from the ledger it does not.
        assert (await c.post("/v1/chat/completions", json=req(110))).status_code == 429
        assert (await c.post("/v1/chat/completions", json=req(99))).status_code == 200
        counters = (await gw.budgets.inspect()).counters
        seen = {(x.scope.value, x.window): x.tokens for x in counters}
        assert {(x.scope.value, x.window): x.requests for x in counters}[("global", "daily")] == 3
        assert seen[("per_api_key", "hourly")] == 3 * USED
        assert seen[("per_model", "daily")] == 3 * USED
        assert seen[("global", "hourly")] == 3 * USED
        # A reset stays a reset: the bucket is not rebuilt over it.
        await gw.budgets.reset("per_api_key", team_id="acme", api_key_id="alpha")
        assert (await c.post("/v1/chat/completions", json=req())).status_code == 200
        # The fleet's fifth request of the day: the key has room, the day's requests don't.
        fifth = await c.post("/v1/chat/completions", json=req())
        assert fifth.status_code == 429
        assert fifth.json()["error"]["details"]["unit"] == "requests"
