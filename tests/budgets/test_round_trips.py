"""What budgets cost in Redis round trips: none. A warm inference at concurrency 1 sends two
pipelines with budgets on or off, on one server and on a cluster: the budgets' reserve leaves
in the preflight's pipeline write, their commit in the postflight's."""

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


def pipelines(gw: BudgetGateway) -> tuple[int, int]:
    """Pipelines sent, and script calls they carried, by every pipeline the gateway has."""
    found: dict[int, Any] = {id(gw.store.pipeline): gw.store.pipeline}
    if gw.gate.redis is not None:
        budget_store: Any = gw.gate.redis
        found[id(budget_store.pipeline)] = budget_store.pipeline
    return (
        sum(p.stats.batches for p in found.values()),
        sum(p.stats.calls for p in found.values()),
    )


@pytest.mark.parametrize("where", ["redis", "cluster"])
@pytest.mark.parametrize(
    ("enabled", "stock", "scripts"),
    # Scripts in five warm inferences (after three): the spend limits' two each, and with
    # budgets a reserve and a commit per bucket (key, model, global)...
    [
        (True, 0, 5 * 8),
        # ...or, with eight holds stocked in the model's and the global bucket, the key's
        # reserve alone on the way in: the first request reserved centrally and stocked
        # eight, the next ones take one each, and the one that leaves four on the shelf
        # (the fourth of these five) sends a refill of four to both buckets. On the way out
        # the key's commit alone: the stocked holds' commits in the model's and the global
        # bucket wait to be carried by a later finishing round (engine/carryover.py), which
        # none of these five is (fewer than RIDE_AT requests' wait).
        (True, 8, 5 * 4 + 2),
        (False, 8, 5 * 2),
    ],
)
async def test_pipelines_per_warm_inference(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    where: str,
    enabled: bool,
    stock: int,
    scripts: int,
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
        budget_stock=stock,
    )
    async with gw, gw.client() as c:
        await gw.policy(Period.DAY, 10**9)
        for _ in range(3):  # warm: policy cached, buckets seeded, scripts loaded
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=10))).is_success
        await gw.guard.recorder.flush()
        # The records writer would send the waiting writes before removing entries (below):
        # off the request path, not counted here.
        held: list[Any] = []
        gw.guard.recorder.submit = held.append  # type: ignore[method-assign]
        batches, calls = pipelines(gw)
        for _ in range(5):
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=10))).is_success
        after = pipelines(gw)
        assert after[0] - batches == 5 * 2  # one round trip before the provider, one after
        assert after[1] - calls == scripts
        carry = gw.guard.carryover
        # What waits: every request's commit in the model's and the global bucket, as one
        # write per bucket.
        assert carry is not None and len(carry) == (2 if enabled and stock else 0)
        await carry.settle()  # what the records writer does before it removes their entries
        settled = pipelines(gw)
        sent = 1 if enabled and stock else 0
        assert settled[0] - after[0] == sent and settled[1] - after[1] == 2 * sent
    await spend.aclose()
