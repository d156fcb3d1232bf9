"""The cache sync: a pass costs in proportion to what changed since the last one, and the cache
stays settled + pending whoever settled, with each estimate dropped once (design.md,
"Settlement")."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from spendguard import Settings, SpendGuard
from spendguard.clock import to_micros, utcnow
from spendguard.engine.cachesync import JOURNAL_KEEP_US, CacheSync
from spendguard.engine.worker import SettlementWorker
from spendguard.errors import StoreUnavailable
from spendguard.identity import Identity
from spendguard.ledger import Ledger, SettledRecord
from spendguard.limits import Limit, Period, Policy, key_limit
from spendguard.record import PostflightStatus
from spendguard.store import EntryWrite, RefreshEntry
from spendguard.store.memory import MemoryStore
from spendguard.store.redis import RedisStore
from spendguard.usage import Usage
from tests.engine.helpers import (
    ALPHA,
    DoubledWorker,
    cached,
    day_key,
    doubled_worker,
    running_guard,
    set_limit,
    spend,
)
from tests.support import Clock, Counting, Override, make_record, write_unit_prices

pytestmark = pytest.mark.anyio


def replica_settings(database_url: str, tmp_path: Path) -> Settings:
    """A gateway whose worker only keeps its cache in sync: another process settles."""
    return Settings(database_url=database_url, prices=write_unit_prices(tmp_path), run_worker=False)


@pytest.fixture
async def guard(database_url: str, tmp_path: Path) -> AsyncIterator[SpendGuard]:
    async with running_guard(replica_settings(database_url, tmp_path)) as g:
        yield g


@pytest.fixture
async def elsewhere(database_url: str) -> AsyncIterator[Ledger]:
    """The ledger connection of another process: a standalone worker, the CLI."""
    led = Ledger(database_url)
    await led.connect()
    try:
        yield led
    finally:
        await led.disconnect()


async def settle_elsewhere(g: SpendGuard, ledger: Ledger) -> int:
    """Settle every record at twice its estimate, from another process (no access to g's
    cache): an estimate replaced by its charge doubles, one left behind shows."""
    return (await doubled_worker(g, None, ledger=ledger).run_once()).settled


async def test_a_pass_with_many_markers_and_nothing_settled_reads_none(
    guard: SpendGuard, elsewhere: Ledger
) -> None:
    await set_limit(guard, 10**9)
    await spend(guard, 1)
    await guard.recorder.flush()
    key = day_key(guard)
    # Finished inferences whose records are not settled yet: one pending estimate each.
    for i in range(2000):
        assert await guard.store.postflight(f"pending{i}", 3, [key]) == 1
    store, ledger = Counting(guard.store), Counting(guard.ledger)
    worker = SettlementWorker(
        ledger, store, guard.coster, guard.codec, settle=False, clock=guard.clock
    )  # type: ignore[arg-type]
    await worker.run_once()  # a first pass reconciles by the markers, once
    assert store.calls["pending_records"] == 1

    store.calls.clear()
    ledger.calls.clear()
    for _ in range(3):
        assert (await worker.run_once()).teams_refreshed == 0
    assert dict(store.calls) == {}  # not one marker read, not one refresh
    # Per pass: policy changes, top-ups, the journal's new rows; nothing per pending estimate.
    assert dict(ledger.calls) == {
        "session": 3,
        "policies_changed_since": 3,
        "topped_up_since": 3,
        "journal_after": 3,
    }

    assert await settle_elsewhere(guard, elsewhere) == 1
    store.calls.clear()
    ledger.calls.clear()
    assert (await worker.run_once()).teams_refreshed == 1
    assert dict(store.calls) == {"refresh": 1}  # the one team the settlement touched
    assert ledger.calls["journal_records"] == 1 and "settled_records" not in ledger.calls
    assert await cached(guard) == 2 + 2000 * 3  # its estimate replaced, the others pending


async def test_each_replica_drops_estimates_settled_elsewhere_once(
    database_url: str, tmp_path: Path, elsewhere: Ledger
) -> None:
    settings = replica_settings(database_url, tmp_path)
    clock = Clock()
    stores = [MemoryStore(clock=clock) for _ in range(2)]
    replicas = [SpendGuard(settings, store=s, clock=clock) for s in stores]
    for replica in replicas:
        await replica.start(worker=False)
    try:
        a, b = replicas
        await set_limit(a, 10**6)
        for replica in replicas:
            await replica.worker.run_once()  # past their first pass: following the journal
        await spend(a, 10)
        await spend(b, 20)
        await spend(b, 5)
        for replica in replicas:
            await replica.recorder.flush()
        assert (await cached(a), await cached(b)) == (10, 25)  # each its own estimates
        assert await settle_elsewhere(a, elsewhere) == 3
        for replica in replicas:
            await replica.worker.run_once()
        # Each cache: the exact settled total, every estimate of its own gone, once.
        assert (await cached(a), await cached(b)) == (70, 70)
        for replica in replicas:
            await replica.worker.run_once()
        assert (await cached(a), await cached(b)) == (70, 70)
    finally:
        for replica in reversed(replicas):
            await replica.stop()


async def test_replicas_on_one_redis_drop_each_estimate_once(
    database_url: str, redis_url: str, tmp_path: Path, elsewhere: Ledger
) -> None:
    settings = replica_settings(database_url, tmp_path)
    clock = Clock(utcnow())  # Redis expires keys by its own clock
    stores = [RedisStore.from_url(redis_url, timeout=2) for _ in range(2)]
    replicas = [SpendGuard(settings, store=s, clock=clock) for s in stores]
    for replica in replicas:
        await replica.start(worker=False)
    try:
        a, b = replicas
        await set_limit(a, 10**6)
        for replica in replicas:
            await replica.worker.run_once()
        await spend(a, 10)
        await spend(b, 20)
        for replica in replicas:
            await replica.recorder.flush()
        lost = make_record("lost", clock(), 4, postflight=PostflightStatus.UNKNOWN)
        await a.ledger.insert_records([lost])  # its postflight's outcome was not known
        assert await cached(a) == 30
        assert await settle_elsewhere(a, elsewhere) == 3
        await a.worker.run_once()
        assert await cached(a) == 68  # (10 + 20 + 4) x 2, no estimate left
        await b.worker.run_once()  # the same records, the same keys: nothing twice
        assert await cached(b) == 68
        # The unknown outcome's postflight landing now adds nothing: a tombstone waits for it.
        assert await stores[0].postflight("lost", 4, [day_key(a)]) == 0
        for replica in replicas:
            await replica.worker.run_once()
        assert await cached(a) == 68
    finally:
        for replica in reversed(replicas):
            await replica.stop()
        for store in stores:
            await store.aclose()


async def test_records_held_through_a_failed_refresh_leave_the_cache_next_pass(
    guard: SpendGuard, elsewhere: Ledger
) -> None:
    down = False

    async def refresh(entries: Sequence[RefreshEntry]) -> None:
        if down:
            raise StoreUnavailable("redis unavailable")
        await guard.store.refresh(entries)

    store = Override(guard.store, refresh=refresh)
    worker = SettlementWorker(
        guard.ledger,
        store,
        guard.coster,
        guard.codec,
        settle=False,
        clock=guard.clock,  # type: ignore[arg-type]
    )
    await set_limit(guard, 10**6)
    await spend(guard, 40)
    await guard.recorder.flush()
    await worker.run_once()
    assert await settle_elsewhere(guard, elsewhere) == 1
    down = True
    assert (await worker.run_once()).refresh_failures == 1
    assert await cached(guard) == 40  # the estimate still counts: never under
    down = False
    await worker.run_once()  # past the journal row already: the records were held
    assert await cached(guard) == 80


async def test_a_settlement_committed_after_a_later_one_is_not_missed(
    guard: SpendGuard, elsewhere: Ledger
) -> None:
    # Journal numbers are taken before commit: on PostgreSQL the row numbered first may
    # become visible after a later one. Hidden here from the journal reads until it "commits".
    hidden: set[int] = set()

    async def journal_after(after: int, limit: int) -> list[int]:
        return [s for s in await guard.ledger.journal_after(after, limit) if s not in hidden]

    async def journal_records(seqs: Sequence[int]) -> dict[int, list[SettledRecord]]:
        found = await guard.ledger.journal_records(seqs)
        return {s: records for s, records in found.items() if s not in hidden}

    ledger = Override(guard.ledger, journal_after=journal_after, journal_records=journal_records)
    worker = SettlementWorker(
        ledger,
        guard.store,
        guard.coster,
        guard.codec,
        settle=False,
        clock=guard.clock,  # type: ignore[arg-type]
    )
    await set_limit(guard, 10**6)
    await worker.run_once()
    seqs = []
    for tokens in (10, 20):
        await spend(guard, tokens)
        await guard.recorder.flush()
        batch = await elsewhere.settle(100, lambda r: 2 * r.input_tokens, guard.clock())
        assert batch.seq is not None
        seqs.append(batch.seq)
    hidden.add(seqs[0])
    await worker.run_once()
    # The later batch's estimate is gone; the earlier one's stays until its row is read (the
    # aggregate already has its charge here, as the row is only hidden: over, never under).
    assert await cached(guard) == 60 + 10
    hidden.clear()
    await worker.run_once()
    assert await cached(guard) == 60


async def test_a_process_behind_the_journal_pruning_reconciles_by_markers(
    guard: SpendGuard, elsewhere: Ledger
) -> None:
    await set_limit(guard, 10**6)
    await spend(guard, 40)
    await guard.recorder.flush()
    await guard.worker.run_once()
    assert await settle_elsewhere(guard, elsewhere) == 1
    guard.clock.now += timedelta(minutes=30)  # type: ignore[attr-defined]
    await elsewhere.prune_journal(to_micros(guard.clock()) - JOURNAL_KEEP_US)
    assert await elsewhere.journal_after(0, 10) == []  # the row it never read is gone
    await guard.worker.run_once()
    assert await cached(guard) == 80


async def test_an_estimate_the_journal_cannot_show_goes_with_the_hourly_reconcile(
    guard: SpendGuard, elsewhere: Ledger
) -> None:
    await set_limit(guard, 10**6)
    rid = await spend(guard, 40)
    await guard.recorder.flush()
    await guard.worker.run_once()
    assert await settle_elsewhere(guard, elsewhere) == 1
    await guard.worker.run_once()
    assert await cached(guard) == 80
    # The record's estimate shows up again after its settlement was synced (a postflight that
    # reached the store that late, into a key filled meanwhile): no journal row will name it.
    assert await guard.store.postflight(rid, 40, [day_key(guard)]) == 1
    for _ in range(11):  # passes every 5 minutes: nothing changed, nothing read
        guard.clock.now += timedelta(minutes=5)  # type: ignore[attr-defined]
        await guard.worker.run_once()
        assert await cached(guard) == 120
    guard.clock.now += timedelta(minutes=5)  # type: ignore[attr-defined]
    await guard.worker.run_once()  # an hour on: the backstop reads the markers
    assert await cached(guard) == 80


async def test_a_key_filled_from_a_read_before_a_settlement_is_raised_next_pass(
    database_url: str, tmp_path: Path, elsewhere: Ledger
) -> None:
    clock = Clock()
    real = Ledger(database_url)
    g: SpendGuard

    async def load_aggregates(team: str, wanted: Any) -> dict[tuple[Limit, str], int]:
        # The fill reads the ledger; a settlement commits and this process's pass runs (the
        # key is still absent: nothing to refresh); then the fill writes what it read.
        before = await real.load_aggregates(team, wanted)
        assert await settle_elsewhere(g, elsewhere) == 1
        await g.worker.run_once()
        return before

    ledger = Override(real, load_aggregates=load_aggregates)
    settings = replica_settings(database_url, tmp_path)
    g = SpendGuard(settings, store=MemoryStore(clock=clock), ledger=ledger, clock=clock)  # type: ignore[arg-type]
    await g.start(worker=False)
    try:
        await set_limit(g, 10**6)
        await g.worker.run_once()
        await real.insert_records([make_record("elsewhere", clock(), 40)])  # another replica's
        assert (await g.preflight(ALPHA, clock())).verdict == "allow"  # fills the key
        assert await cached(g) == 0  # the stale read: 80 is settled
        await g.worker.run_once()
        assert await cached(g) == 80
    finally:
        await g.stop()


async def test_a_topup_made_elsewhere_reaches_the_cached_balance(
    guard: SpendGuard, elsewhere: Ledger
) -> None:
    await guard.ledger.topup(team="acme", team_id="acme", micros=10, now=guard.clock())
    await guard.worker.run_once()
    await spend(guard, 10)
    await guard.worker.run_once()  # (refreshes the keys the spend filled)
    assert (await guard.preflight(ALPHA, guard.clock())).balance_exhausted
    guard.clock.now += timedelta(seconds=1)  # type: ignore[attr-defined]
    await elsewhere.topup(team="acme", team_id="acme", micros=100, now=guard.clock())
    await guard.worker.run_once()
    assert (await guard.preflight(ALPHA, guard.clock())).verdict == "allow"


async def test_a_team_whose_refresh_fails_for_any_reason_does_not_stop_the_others(
    guard: SpendGuard, elsewhere: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only the store being down: a value a store refuses (a script's own check raises
    ValueError) for one team must leave every other team's refresh in the same pass."""
    other = Identity("globex", "k")
    other_day = key_limit(other, Period.DAY)

    async def refresh(entries: Sequence[RefreshEntry]) -> None:
        if any("acme" in e.usage_key for e in entries):
            raise ValueError("spendguard refresh: bad entry header")
        await guard.store.refresh(entries)

    worker = SettlementWorker(
        guard.ledger,
        Override(guard.store, refresh=refresh),
        guard.coster,
        guard.codec,
        settle=False,
        clock=guard.clock,  # type: ignore[arg-type]
    )
    await set_limit(guard, 10**6)
    await guard.ledger.set_policy(Policy(other_day, 10**6, "globex", "k"), now=guard.clock())
    await spend(guard, 40)
    decision = await guard.preflight(other, guard.clock())
    await guard.postflight(
        decision, model="unit-model", route="/v1/chat/completions", status_code=200,
        usage=Usage(input_tokens=30),
    )  # fmt: skip
    await guard.recorder.flush()
    await worker.run_once()
    assert await settle_elsewhere(guard, elsewhere) == 2
    result = await worker.run_once()
    assert result.refresh_failures == 1
    other_key = guard.codec.check(other_day, guard.clock()).usage_key
    assert (await guard.store.read_usage([other_key]))[other_key] == 60  # refreshed: charge
    assert await cached(guard) == 40  # acme: still its estimate, retried next pass
    assert "cache refresh failed for team acme" in caplog.text


async def test_an_estimate_whose_record_never_comes_is_removed_on_its_second_sighting(
    guard: SpendGuard,
) -> None:
    """A marker with no record in the ledger and no admission entry (a record the database
    refused) would inflate usage until its key expires; a later reconcile removes it. Markers
    whose record is in the ledger, or still in an entry, stay."""
    await set_limit(guard, 10**9)
    spent = await spend(guard, 1)  # recorded, not settled here: its estimate stays
    await guard.recorder.flush()
    key = day_key(guard)
    store = guard.store
    entries = guard.codec.entries_key(ALPHA.team)
    plan = guard.codec.plan(ALPHA, guard.clock())
    await store.preflight(plan, EntryWrite(entries, "inflight", "entry"))
    assert await store.postflight("inflight", 5, [key], entry_key=entries, closed="rec") == 1
    assert await store.postflight("ghost", 7, [key]) == 1
    assert await store.postflight("coming", 11, [key]) == 1
    await guard.ledger.insert_records([make_record("coming", guard.clock(), 11)])
    before = await cached(guard)
    worker = SettlementWorker(guard.ledger, store, guard.coster, guard.codec, settle=False,
                              clock=guard.clock)  # fmt: skip
    await worker.run_once()  # a first pass reconciles: the ghost is seen once
    assert await cached(guard) == before
    guard.clock.now += timedelta(hours=1, seconds=1)  # type: ignore[attr-defined]
    await worker.run_once()  # the hourly reconcile sees it again: removed
    assert await cached(guard) == before - 7
    assert set((await store.pending_records([key]))[key]) == {"inflight", "coming", spent}


class _StaleRead:
    """The ledger's aggregates read, then held until released: a pass that read them before a
    settlement committed and goes on after it."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.armed = False
        self.reading = anyio.Event()
        self.release = anyio.Event()

    async def policy_aggregates(self, now: Any, teams: Any = None) -> Any:
        values = await self.ledger.policy_aggregates(now, teams)
        if self.armed:
            self.armed = False
            self.reading.set()
            await self.release.wait()
        return values


async def test_records_settled_while_a_pass_reads_the_ledger_leave_with_the_next_pass(
    guard: SpendGuard,
) -> None:
    await set_limit(guard, 10**6)
    await spend(guard, 40)
    await guard.recorder.flush()
    stale = _StaleRead(guard.ledger)
    ledger = Override(guard.ledger, policy_aggregates=stale.policy_aggregates)
    sync = CacheSync(ledger, guard.store, guard.codec, guard.clock)  # type: ignore[arg-type]
    await sync.run()  # the first pass: markers read, nothing settled
    assert await cached(guard) == 40

    sync.filled("acme")  # something for the next pass to refresh
    stale.armed = True
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(sync.run)
        await stale.reading.wait()  # the pass has read the aggregates (nothing settled)
        # This process settles meanwhile and hands its records over.
        batch = await guard.ledger.settle(100, lambda r: 2 * r.input_tokens, guard.clock())
        assert batch.charged == 1
        sync.settled(batch)
        stale.release.set()
    # The pass that read before the settlement kept the estimate (dropped with a value lacking
    # its charge, the key would show 0 spent); the next one replaces it by the charge.
    assert await cached(guard) == 40
    await sync.run()
    assert await cached(guard) == 80


async def test_a_pass_asked_for_while_one_runs_waits_for_it(guard: SpendGuard) -> None:
    await set_limit(guard, 10**6)
    await spend(guard, 40)
    stale = _StaleRead(guard.ledger)
    order: list[str] = []

    async def settle(*args: Any) -> Any:
        order.append("settle")
        return await guard.ledger.settle(*args)

    ledger = Override(guard.ledger, policy_aggregates=stale.policy_aggregates, settle=settle)
    worker = DoubledWorker(ledger, guard.store, guard.coster, guard.codec, clock=guard.clock)  # type: ignore[arg-type]
    worker.note_filled("acme")
    stale.armed = True

    async def first() -> None:
        await worker.run_once()  # settles nothing: the record is not written yet
        order.append("first done")

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(first)
        await stale.reading.wait()
        await guard.recorder.flush()  # the record reaches the ledger mid-pass
        tasks.start_soon(worker.run_once)  # the loop's pass, or an admin's settle
        await anyio.wait_all_tasks_blocked()
        stale.release.set()
    # The second pass settled only once the first was done, and its refresh used the ledger's
    # values after its own settlement.
    assert order == ["settle", "first done", "settle"]
    assert await cached(guard) == 80
