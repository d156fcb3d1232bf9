"""Tests for spendguard.engine.fill: after a miss, what is missing is read from the ledger once
(concurrent misses coalesce) and only absent keys are written."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import pytest

from spendguard.engine.fill import CacheFiller
from spendguard.errors import LedgerUnavailable
from spendguard.identity import Identity
from spendguard.ledger import Ledger
from spendguard.limits import Balance, KeyCodec, Period, Policy, key_limit, team_limit
from spendguard.store import Outcome, Preflight
from spendguard.store.memory import MemoryStore
from tests.support import Clock, Counting, Override

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
KEY_DAY, TEAM_MONTH = key_limit(ALPHA, Period.DAY), team_limit(ALPHA, Period.MONTH)
CODEC = KeyCodec("quota", timedelta(days=2))


def filler(ledger: Any, store: MemoryStore, *, db_timeout: float = 5.0) -> CacheFiller:
    async def ensure_connected() -> None:
        pass  # the ledger fixture is connected already

    return CacheFiller(
        ledger,
        store,
        CODEC,
        policy_ttl=60,
        db_timeout=db_timeout,
        ensure_connected=ensure_connected,
    )


async def set_policies(ledger: Ledger, clock: Clock) -> None:
    await ledger.set_policy(Policy(KEY_DAY, 1_000, "acme", "alpha"), now=clock())
    await ledger.set_policy(Policy(TEAM_MONTH, 5_000, "acme"), now=clock())


async def miss_then_fill(cf: CacheFiller, store: MemoryStore, clock: Clock) -> Preflight:
    plan = CODEC.plan(ALPHA, clock())
    miss = await store.preflight(plan)
    assert miss.outcome is Outcome.MISS
    await cf.fill(plan, miss)
    return await store.preflight(plan)


async def test_a_policy_miss_fills_the_policy_and_its_usage_keys(ledger: Ledger) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    await set_policies(ledger, clock)
    after = await miss_then_fill(filler(ledger, store), store, clock)
    assert after.outcome is Outcome.ALLOW
    assert {(s.check.target, s.limit, s.used) for s in after.limits} == {
        (KEY_DAY, 1_000, 0),
        (TEAM_MONTH, 5_000, 0),
    }
    # Only limits with a policy got a usage key.
    plan = CODEC.plan(ALPHA, clock())
    other = plan.find(key_limit(ALPHA, Period.MONTH)).usage_key
    assert await store.read_usage([other]) == {other: None}


async def test_concurrent_misses_of_one_team_make_one_ledger_read_each(ledger: Ledger) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    await set_policies(ledger, clock)

    def slow(name: str) -> Any:
        real = getattr(ledger, name)

        async def call(*args: Any) -> Any:
            await anyio.sleep(0.05)  # every request misses while the first read is under way
            return await real(*args)

        return call

    counted = Counting(
        Override(ledger, load_limits=slow("load_limits"), load_aggregates=slow("load_aggregates"))
    )
    cf = filler(counted, store)
    plan = CODEC.plan(ALPHA, clock())
    miss = await store.preflight(plan)
    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(cf.fill, plan, miss)
    assert dict(counted.calls) == {
        "load_limits": 1,
        "load_models": 1,
        "load_rates": 1,
        "load_aggregates": 1,
    }
    assert (await store.preflight(plan)).outcome is Outcome.ALLOW


async def test_a_usage_miss_reads_only_the_aggregates(ledger: Ledger) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    await set_policies(ledger, clock)
    counted = Counting(ledger)
    cf = filler(counted, store)
    plan = CODEC.plan(ALPHA, clock())
    # The policy is cached (say the usage key expired): only the usage is missing.
    fields = CODEC.policy_fields(await ledger.list_policies("acme"), balance=False)
    await store.fill(plan, fields, [], policy_ttl=60)
    miss = await store.preflight(plan)
    assert not miss.missing_policy and len(miss.missing_usage) == 2
    await cf.fill(plan, miss)
    assert dict(counted.calls) == {"load_aggregates": 1}
    assert (await store.preflight(plan)).outcome is Outcome.ALLOW


async def test_a_balance_is_filled_from_the_account(ledger: Ledger) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    await ledger.topup(team="acme", team_id="acme", micros=300)
    after = await miss_then_fill(filler(ledger, store), store, clock)
    assert after.outcome is Outcome.ALLOW
    assert [(s.check.target, s.limit, s.used) for s in after.limits] == [(Balance("acme"), 300, 0)]


async def test_an_account_that_vanished_between_reads_fills_nothing(ledger: Ledger) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    await ledger.topup(team="acme", team_id="acme", micros=300)

    async def closed(team: str) -> None:
        return None  # the account is gone by the time its balance is read

    plan = CODEC.plan(ALPHA, clock())
    cf = filler(Override(ledger, load_balance=closed), store)
    await cf.fill(plan, await store.preflight(plan))
    balance_key = plan.find(Balance("acme")).usage_key
    assert await store.read_usage([balance_key]) == {balance_key: None}
    again = await store.preflight(plan)  # the policy says "balance": the next request re-reads
    assert again.outcome is Outcome.MISS
    assert [c.target for c in again.missing_usage] == [Balance("acme")]


async def test_a_hung_ledger_read_is_bounded_by_the_db_timeout(ledger: Ledger) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)

    async def hung(team: str) -> Any:
        await anyio.sleep_forever()

    cf = filler(Override(ledger, load_limits=hung), store, db_timeout=0.1)
    plan = CODEC.plan(ALPHA, clock())
    with anyio.fail_after(5), pytest.raises(TimeoutError):
        await cf.fill(plan, await store.preflight(plan))
    assert (await store.preflight(plan)).missing_policy  # nothing was written


async def test_a_policy_read_while_the_ledger_is_down_serves_the_last_one_for_a_bounded_time(
    ledger: Ledger,
) -> None:
    clock = Clock()
    now = [0.0]
    store = MemoryStore(clock=clock)
    await set_policies(ledger, clock)
    down = Override(ledger)

    async def ensure_connected() -> None:
        pass

    cf = CacheFiller(
        down,  # type: ignore[arg-type]
        store,
        CODEC,
        policy_ttl=60,
        db_timeout=5,
        ensure_connected=ensure_connected,
        policy_stale_max=600,
        monotonic=lambda: now[0],
    )
    assert (await miss_then_fill(cf, store, clock)).outcome is Outcome.ALLOW  # read: known

    async def unreachable(*args: object) -> Any:
        raise LedgerUnavailable("connection refused")

    down.load_limits = unreachable  # type: ignore[method-assign]
    down.load_aggregates = unreachable  # type: ignore[method-assign]
    clock.now += timedelta(seconds=61)  # the cached policy expired; its usage keys did not
    now[0] = 600.0
    after = await miss_then_fill(cf, store, clock)  # the last read, 600 s old: still served
    assert after.outcome is Outcome.ALLOW
    assert {(s.check.target, s.limit) for s in after.limits} == {
        (KEY_DAY, 1_000),
        (TEAM_MONTH, 5_000),
    }
    clock.now += timedelta(seconds=61)
    now[0] = 600.5  # past the bound: the ledger's answer is needed again
    plan = CODEC.plan(ALPHA, clock())
    with pytest.raises(LedgerUnavailable):
        await cf.fill(plan, await store.preflight(plan))
    # A team never read has nothing to fall back on.
    other = CODEC.plan(Identity("globex"), clock())
    with pytest.raises(LedgerUnavailable):
        await cf.fill(other, await store.preflight(other))
