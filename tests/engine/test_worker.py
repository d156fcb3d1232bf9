"""Settlement and cache sync: exact charges replace estimates with no gap, crashes heal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from spendguard import Settings, SpendGuard
from spendguard.engine.worker import SettlementWorker
from spendguard.store.memory import MemoryStore
from spendguard.usage import Usage
from tests.engine.helpers import (
    ALPHA,
    cached,
    day_key,
    doubled_worker,
    running_guard,
    set_limit,
    spend,
)
from tests.support import Override, write_unit_prices

pytestmark = pytest.mark.anyio


@pytest.fixture
async def guard(database_url: str, tmp_path: Path) -> AsyncIterator[SpendGuard]:
    async with running_guard(
        Settings(database_url=database_url, prices=write_unit_prices(tmp_path))
    ) as g:
        yield g


async def test_cache_is_settled_plus_pending_through_settlement(guard: SpendGuard) -> None:
    await set_limit(guard, 10_000)
    await spend(guard, 100)
    await spend(guard, 30)
    assert await cached(guard) == 130  # estimates, before any settlement
    await guard.recorder.flush()
    # A finished inference whose record has not reached the ledger yet: only its marker.
    assert await guard.store.postflight("in-flight", 7, [day_key(guard)]) == 1
    worker = doubled_worker(guard, guard.store)
    result = await worker.run_once()
    assert result.settled == 2 and result.total_micros == 260
    # Settled 260 (exact) + pending 7: estimates replaced, not added, and no gap.
    assert await cached(guard) == 267
    await worker.run_once()
    assert await cached(guard) == 267
    assert await guard.ledger.charges_total() == 260


async def test_refresh_lost_to_a_crash_heals_on_the_next_pass(guard: SpendGuard) -> None:
    await set_limit(guard, 10_000)
    await spend(guard, 50)
    await guard.recorder.flush()

    class Crash(BaseException):
        """The process dies between the DB commit and the cache refresh (an error would be
        caught, counted and retried by the pass itself)."""

    async def crash(*args: object) -> None:
        raise Crash

    worker = doubled_worker(guard, Override(guard.store, refresh=crash))
    with pytest.raises(Crash):
        await worker.run_once()
    assert await guard.ledger.charges_total() == 100  # the DB committed (exact: 2x)
    assert await cached(guard) == 50  # the estimate is still there: not lost
    await guard.worker.run_once()  # nothing new to settle; the refresh heals
    assert await cached(guard) == 100  # the exact charge replaced the estimate


async def test_records_settled_by_another_process_leave_this_cache(
    guard: SpendGuard, database_url: str, tmp_path: Path
) -> None:
    await set_limit(guard, 10_000)
    await spend(guard, 40)
    await guard.recorder.flush()
    # A standalone `spendguard settle` with its own connection and no access to this cache.
    other = SpendGuard(
        Settings(database_url=database_url, prices=write_unit_prices(tmp_path)),
        store=MemoryStore(),
    )
    await other.start(worker=False)
    assert (await doubled_worker(other, store=None).run_once()).settled == 1
    await other.stop()
    assert await cached(guard) == 40
    await guard.worker.run_once()  # this process's sync drops the marker, takes the aggregate
    assert await cached(guard) == 80
    await spend(guard, 2)
    assert await cached(guard) == 82


async def test_policy_changed_elsewhere_is_evicted_by_the_next_pass(guard: SpendGuard) -> None:
    await set_limit(guard, 10_000)
    assert (await guard.preflight(ALPHA, guard.clock())).verdict == "allow"
    await set_limit(guard, 0)  # as the CLI would: the DB only
    assert (await guard.preflight(ALPHA, guard.clock())).verdict == "allow"  # cached policy
    await guard.worker.run_once()
    assert (await guard.preflight(ALPHA, guard.clock())).verdict == "deny"


async def test_unknown_model_is_charged_the_default_price(guard: SpendGuard) -> None:
    decision = await guard.preflight(ALPHA, guard.clock())
    await guard.postflight(
        decision,
        model="brand-new-model",
        route="/v1/chat/completions",
        status_code=200,
        usage=Usage(input_tokens=3, output_tokens=4),
    )
    await guard.recorder.flush()
    await guard.worker.run_once()
    assert await guard.ledger.charges_total() == 7  # the unit table's "default": 1 per token


async def test_second_sqlite_worker_says_so_and_does_not_settle(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import anyio

    settings = Settings(database_url=sqlite_url, prices=write_unit_prices(tmp_path))
    first, second = SpendGuard(settings), SpendGuard(settings)
    await first.start(worker=False)
    await second.start(worker=False)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(first.worker.run, 60.0)
            await tg.start(second.worker.run, 60.0)
            assert first.worker.settling and not second.worker.settling
            tg.cancel_scope.cancel()
        assert "SQLite supports a single worker" in caplog.text
    finally:
        await second.stop()  # own task groups: closed in reverse order of opening
        await first.stop()


async def test_the_second_sqlite_worker_takes_over_when_the_first_stops(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lock is the OS's, released when its holder stops or dies: the worker standing by
    takes it on its next pass and settles what the first left (a dead gateway's entries
    included, on a shared store)."""
    import anyio

    settings = Settings(database_url=sqlite_url, prices=write_unit_prices(tmp_path))
    first, second = SpendGuard(settings), SpendGuard(settings)
    await first.start(worker=False)
    await second.start(worker=False)
    try:
        first_scope = anyio.CancelScope()

        async def settle_first(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with first_scope:
                await first.worker.run(60.0, task_status=task_status)

        async with anyio.create_task_group() as tg:
            await tg.start(settle_first)
            await tg.start(second.worker.run, 0.05)
            assert first.worker.settling and not second.worker.settling
            decision = await second.preflight(ALPHA, second.clock())
            await second.postflight(
                decision,
                model="brand-new-model",
                route="/v1/chat/completions",
                status_code=200,
                usage=Usage(input_tokens=3, output_tokens=4),
            )
            await second.recorder.flush()
            await anyio.sleep(0.3)
            assert await second.ledger.charges_total() == 0  # standing by: nothing settled
            first_scope.cancel()  # the settling worker stops; its lock goes with it
            with anyio.fail_after(5):
                while (total := await second.ledger.charges_total()) == 0:
                    await anyio.sleep(0.05)
            assert total == 7 and second.worker.settling
            tg.cancel_scope.cancel()
        assert "took over settling" in caplog.text
    finally:
        await second.stop()
        await first.stop()


KILLER = """
import os, signal, sys, anyio
from spendguard import Settings
from spendguard.engine.costing import Coster
from spendguard.ledger import Ledger
from spendguard.engine.pricing import PriceTable
from spendguard.settings import UnknownModel
from spendguard.store.redis import RedisStore
from spendguard.engine.worker import SettlementWorker
from spendguard.limits import KeyCodec
from datetime import timedelta

async def main():
    ledger = Ledger(sys.argv[1])
    await ledger.connect()
    real = RedisStore.from_url(sys.argv[2])

    class Dying:  # the DB transaction has committed; the refresh never happens
        def __getattr__(self, name):
            return getattr(real, name)

        async def refresh(self, entries):
            os.kill(os.getpid(), signal.SIGKILL)

    class Doubled(SettlementWorker):  # charges differ from estimates (see DoubledWorker)
        def _price(self, rec):
            return 2 * super()._price(rec)

    store = Dying()
    coster = Coster(PriceTable.load(sys.argv[3]), UnknownModel.DEFAULT_PRICE)
    worker = Doubled(ledger, store, coster, KeyCodec("quota", timedelta(days=2)))
    await worker.run_once()

anyio.run(main)
"""


async def test_worker_process_killed_between_commit_and_refresh_heals(
    clean_postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    import sys

    import anyio

    from spendguard.store.redis import RedisStore

    postgres_url = clean_postgres_url
    store = RedisStore.from_url(redis_url, timeout=2)
    settings = Settings(database_url=postgres_url, prices=write_unit_prices(tmp_path))
    g = SpendGuard(settings, store=store)
    await g.start(worker=False)
    try:
        await set_limit(g, 10_000)
        await spend(g, 50)
        await spend(g, 20)
        await g.recorder.flush()
        assert await cached(g) == 70
        with anyio.fail_after(60):
            killed = await anyio.run_process(
                [sys.executable, "-c", KILLER, postgres_url, redis_url, str(settings.prices)],
                check=False,
            )
        assert killed.returncode == -9, killed.stderr
        assert await g.ledger.charges_total() == 140  # committed before the kill
        assert await cached(g) == 70  # the refresh never ran: estimates, not lost
        await g.worker.run_once()  # any later pass heals: exact charges replace estimates
        assert await cached(g) == 140
    finally:
        await g.stop()
        await store.aclose()


async def test_a_fresh_worker_drops_estimates_of_records_settled_long_before(
    guard: SpendGuard, database_url: str, tmp_path: Path
) -> None:
    await set_limit(guard, 10_000)
    await spend(guard, 40)
    await guard.recorder.flush()
    # Settled by someone else; this process's worker is replaced much later (say a restart
    # after an hour): nothing remembers the settlement, yet the estimate must go.
    assert (await guard.ledger.settle(100, lambda r: 2 * r.input_tokens)).charged == 1
    assert await cached(guard) == 40
    guard.clock.now += timedelta(hours=1)  # type: ignore[attr-defined]
    fresh = SettlementWorker(
        guard.ledger, guard.store, guard.coster, guard.codec, clock=guard.clock
    )
    await fresh.run_once()
    assert await cached(guard) == 80  # exact charge, estimate gone, not doubled
