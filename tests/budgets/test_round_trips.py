"""What budgets cost in Redis round trips: a warm inference at concurrency 1 sends two more
pipelines with budgets on (reserve, commit) than without, on one server and on a cluster; a
section that is off sends none."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from spendguard.limits import Period
from spendguard.store.redis import RedisStore
from tests.support import Clock, RedisCluster, chat_body
from tests.support.budgets import BudgetGateway, section

pytestmark = pytest.mark.anyio

SCOPES = {
    "per_api_key": {"tokens": 10**9},
    "per_model": {"unit-model": {"tokens": 10**9}},
    "global": {"tokens": 10**9, "cost_usd": 1000},
}


def pipelines(gw: BudgetGateway) -> int:
    sent: int = gw.store.pipeline.stats.batches
    if gw.gate.redis is not None:
        budget_store: Any = gw.gate.redis
        sent += budget_store.pipeline.stats.batches
    return sent


@pytest.mark.parametrize("where", ["redis", "cluster"])
@pytest.mark.parametrize(("enabled", "expected"), [(True, 4), (False, 2)])
async def test_pipelines_per_warm_inference(
    tmp_path: Path, request: pytest.FixtureRequest, where: str, enabled: bool, expected: int
) -> None:
    if where == "redis":
        url: str = request.getfixturevalue("redis_url")
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        url = cluster.url
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    spend = RedisStore.from_url(url, timeout=2.0)
    budgets = section(storage="redis", enabled=enabled, scopes=SCOPES)
    gw = BudgetGateway(
        tmp_path,
        clock=Clock(datetime.now(UTC)),  # Redis expires spend keys at absolute times: real ones
        store=spend,
        budgets=budgets,
        redis_url=url,
        key_prefix=prefix,
        redis_timeout=2.0,
    )
    async with gw, gw.client() as c:
        await gw.policy(Period.DAY, 10**9)
        for _ in range(3):  # warm: policy cached, buckets seeded, scripts loaded
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=10))).is_success
        before = pipelines(gw)
        for _ in range(5):
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=10))).is_success
        assert pipelines(gw) - before == 5 * expected
    await spend.aclose()
