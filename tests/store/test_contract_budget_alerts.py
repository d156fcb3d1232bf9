"""Budgets' threshold alerts, fired by the commit that counts the usage, on every store of the
contract harness (memory, a redis-server, a 3-master Cluster): once per threshold and epoch of
the window's length, in tokens and in micro-USD, once under concurrent commits."""

from __future__ import annotations

import anyio
import pytest

from spendguard.alerts.events import BUDGET, TOKENS, USD, parse_bucket_pending
from spendguard.limits.model import BudgetLimit
from spendguard.store import Store
from spendguard.store.rolling import Bucket, BucketCheck, Commit, WindowCheck
from tests.store.conftest import Harness
from tests.store.test_contract_windows import DAY, FLEET, HOUR, KEY, MINUTE, MODEL, T0, hold

pytestmark = pytest.mark.anyio

EPOCH = T0 // HOUR.period_ms


@pytest.fixture
def store(harness: Harness) -> Store:
    return harness.store


def budget(bucket: Bucket, limit: BudgetLimit, *windows: object) -> BucketCheck:
    return BucketCheck(bucket, tuple(WindowCheck(w, limit) for w in windows or (HOUR,)))  # type: ignore[arg-type]


async def commit(store: Store, call: BucketCheck, at: int, tokens: int, cost: int = 0) -> int:
    h = hold(at, tokens)
    [fired] = await store.commit_buckets(
        [call], h.id, now_ms=at, at_ms=at, tokens=tokens, cost=cost, ttl_ms=h.ttl_ms
    )
    return fired


async def pending(store: Store, bucket: Bucket) -> list[tuple[str, str, int, int, str, int]]:
    """(window, unit, percent, limit, epoch, used) of each alert waiting in the bucket."""
    out = []
    for name, value in (await store.pending_alerts(store.bucket_alerts_key(bucket))).items():
        alert = parse_bucket_pending(bucket, name, value)
        assert alert is not None and alert.scope == BUDGET, name
        out.append(
            (
                alert.window,
                alert.unit,
                alert.percent,
                alert.limit_micros,
                alert.bucket,
                alert.used_micros,
            )
        )
    return sorted(out)


async def test_each_threshold_fires_once_per_epoch_of_the_window(store: Store) -> None:
    call = budget(KEY, BudgetLimit(tokens=100, alert_at=(50, 100)))
    assert await commit(store, call, T0, 40) == 0
    assert await commit(store, call, T0 + MINUTE, 10) == 1  # 50
    assert await commit(store, call, T0 + 2 * MINUTE, 60) == 1  # 110: 100 %, 50 % not again
    assert await commit(store, call, T0 + 3 * MINUTE, 1) == 0
    e = str(EPOCH)
    assert await pending(store, KEY) == [
        ("hourly", TOKENS, 50, 100, e, 50),
        ("hourly", TOKENS, 100, 100, e, 110),
    ]
    # The next hour: minutes 0 and 1 have left the window (61 tokens in it), a new epoch.
    assert await commit(store, call, T0 + 61 * MINUTE, 0) == 1
    assert ("hourly", TOKENS, 50, 100, str(EPOCH + 1), 61) in await pending(store, KEY)
    alert = parse_bucket_pending(
        KEY, *next(iter((await store.pending_alerts(store.bucket_alerts_key(KEY))).items()))
    )
    assert alert is not None and (alert.team, alert.api_key, alert.resets_at) == (
        "acme",
        "alpha",
        None,
    )


async def test_cost_and_tokens_of_several_windows_alert_apart(store: Store) -> None:
    limit = BudgetLimit(tokens=1000, cost_micros=500, alert_at=(80,))
    call = budget(MODEL, limit, HOUR, DAY)
    assert await commit(store, call, T0, 100, cost=400) == 2  # the cost in both windows
    assert await commit(store, call, T0 + 1, 700, cost=0) == 2  # 800 tokens in both
    day_epoch = str(T0 // DAY.period_ms)
    assert await pending(store, MODEL) == [
        ("daily", TOKENS, 80, 1000, day_epoch, 800),
        ("daily", USD, 80, 500, day_epoch, 400),
        ("hourly", TOKENS, 80, 1000, str(EPOCH), 800),
        ("hourly", USD, 80, 500, str(EPOCH), 400),
    ]
    name, value = next(iter((await store.pending_alerts(store.bucket_alerts_key(MODEL))).items()))
    alert = parse_bucket_pending(MODEL, name, value)
    assert alert is not None and (alert.team, alert.model) == ("", "gpt-4o")
    assert "model gpt-4o reached 80% of its" in alert.text


async def test_a_budget_without_thresholds_fires_nothing(store: Store) -> None:
    call = budget(FLEET, BudgetLimit(tokens=10))
    assert await commit(store, call, T0, 50) == 0
    assert await store.pending_alerts(store.bucket_alerts_key(FLEET)) == {}


async def test_concurrent_commits_fire_each_threshold_once(store: Store) -> None:
    call = budget(FLEET, BudgetLimit(tokens=1000, alert_at=(25, 50, 75)))
    fired: list[int] = []

    async def one(i: int) -> None:
        fired.append(await commit(store, call, T0 + i, 10))

    async with anyio.create_task_group() as tg:
        for i in range(100):
            tg.start_soon(one, i)
    assert sum(fired) == 3
    assert [p[2] for p in await pending(store, FLEET)] == [25, 50, 75]


async def test_holds_committed_together_fire_what_they_reach_together_once(store: Store) -> None:
    """A carried batch (``commit_holds``) is checked against the thresholds once, after all
    of its holds: crossing two at once fires both, and a later batch neither again."""
    call = budget(KEY, BudgetLimit(tokens=100, alert_at=(50, 80)))
    done = [Commit(hold(T0, 30).id, T0, 30, 0) for _ in range(3)]
    assert await store.commit_holds(call, done, now_ms=T0, ttl_ms=HOUR.period_ms) == 2
    assert [(u, p, used) for _, u, p, _, _, used in await pending(store, KEY)] == [
        (TOKENS, 50, 90),
        (TOKENS, 80, 90),
    ]
    more = [Commit(hold(T0, 5).id, T0 + MINUTE, 5, 0)]
    assert await store.commit_holds(call, more, now_ms=T0 + MINUTE, ttl_ms=HOUR.period_ms) == 0
