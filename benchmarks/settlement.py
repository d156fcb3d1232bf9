"""4. Settlement, and the record writes that feed it, on SQLite and PostgreSQL; the Redis
preflight script under load.

Settlement: records are written in bulk with ``Ledger.insert_records`` (batches of 500, as the
gateway's record writer does, and timed as "record writes/s"), then one
``SettlementWorker.run_once()`` with ``batch_size`` b settles them all (the worker loops batches
until one comes back short). Records spread over 20 teams x 5 keys (fewer with --quick) that
all have limits, so every charge also updates its key's daily and its team's monthly
aggregate. No cache is attached: this is the SQL side alone.

Several workers: on PostgreSQL, 1, 2 and 4 worker processes (each its own ``Ledger``, as
separate ``spendguard worker`` processes would be) race over the same unsettled records until
none is left, timed from the start signal to the last worker's end. The run then checks that
every record was charged once, at its price: racing workers must never double-charge.

Write path: on PostgreSQL the same records are also written with asyncpg's ``executemany`` on a
statement prepared once, next to ``Ledger.insert_records``: the gap is what the ledger's own
write path costs per record beyond the driver's.

Preflight: ``RedisStore.preflight`` (the preflight Lua script and its client path) on a warm
key, timed per call at concurrency 1 and 64, then at 64 again while a settlement pass with
cache refresh runs in the same event loop, as the in-app worker does.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from queue import Empty
from typing import Any

from spendguard import Identity
from spendguard.engine.costing import Coster
from spendguard.engine.guard import new_record_id
from spendguard.engine.pricing import PriceTable
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger import Ledger
from spendguard.limits import KeyCodec, Limit, Period, Policy, Subject, key_limit
from spendguard.record import InferenceRecord, PostflightStatus
from spendguard.settings import UnknownModel
from spendguard.store import UsageFill
from spendguard.store.redis import RedisStore
from spendguard.usage import Usage

from .apps import INFERENCE_PATH, MODEL
from .common import HIGH_LIMIT_MICROS, Sizes
from .stats import percentile, summary

CODEC = KeyCodec("quota", timedelta(days=2))

KEYS_PER_TEAM = 5
WRITE_BATCH = 500  # the record writer's batch size


def _identities(teams: int) -> list[Identity]:
    return [Identity(f"team{t}", f"key{k}") for t in range(teams) for k in range(KEYS_PER_TEAM)]


def _records(n: int, identities: list[Identity], now: datetime) -> list[InferenceRecord]:
    # Each carries its model's price, as the gateway writes it: settlement reads that.
    found = PriceTable.load(None).lookup(MODEL)
    price = "" if found is None else found.encode()
    out = []
    for i in range(n):
        rid = new_record_id()  # as the gateway draws them
        out.append(
            InferenceRecord(
                id=rid,
                inference_id=rid,
                identity=identities[i % len(identities)],
                model=MODEL,
                route=INFERENCE_PATH,
                t0=now - timedelta(milliseconds=n - i),
                status_code=200,
                usage=Usage(input_tokens=40 + i % 50, output_tokens=5 + i % 20),
                estimate_micros=30,
                postflight=PostflightStatus.APPLIED,
                price=price,
            )
        )
    return out


async def _prepare(url: str, identities: list[Identity]) -> Ledger:
    ledger = Ledger(url)
    await ledger.connect()
    await ledger.init_schema()
    now = datetime.now(UTC)
    for ident in identities:
        day = key_limit(ident, Period.DAY)
        await ledger.set_policy(
            Policy(day, HIGH_LIMIT_MICROS, ident.team_id, ident.api_key_id), now=now
        )
    for team in sorted({i.team for i in identities}):
        month = Limit(Subject(team), Period.MONTH)
        await ledger.set_policy(Policy(month, HIGH_LIMIT_MICROS, team), now=now)
    return ledger


async def _write(ledger: Ledger, records: list[InferenceRecord], batch: int = WRITE_BATCH) -> float:
    start = time.perf_counter()
    for i in range(0, len(records), batch):
        await ledger.insert_records(records[i : i + batch])
    return time.perf_counter() - start


async def _write_cpu(ledger: Ledger, records: list[InferenceRecord], batch: int) -> float:
    """This process's CPU µs per record written: what the gateway's record writer takes from
    the event loop that also serves requests (a lightly loaded gateway writes batches of 1)."""
    start = time.process_time()
    await _write(ledger, records, batch)
    return (time.process_time() - start) / len(records) * 1e6


async def _executemany(ledger: Ledger, url: str, records: list[InferenceRecord]) -> float:
    """Records/s writing ``records`` with asyncpg executemany, one transaction per 500.

    The rows are the ledger's own: written once through the ledger and read back (untimed),
    then deleted and written again by the timed executemany."""
    import asyncpg  # type: ignore[import-untyped]

    await ledger.insert_records(records)
    ids = [r.id for r in records]
    where = "WHERE id = ANY($1::text[])"
    conn = await asyncpg.connect(url)
    try:
        rows = [dict(r) for r in await conn.fetch(f"SELECT * FROM spendguard_records {where}", ids)]
        await conn.execute(f"DELETE FROM spendguard_records {where}", ids)
        columns = list(rows[0])
        sql = (
            f"INSERT INTO spendguard_records ({', '.join(columns)}) "
            f"VALUES ({', '.join(f'${i + 1}' for i in range(len(columns)))}) "
            "ON CONFLICT (id) DO NOTHING"
        )
        start = time.perf_counter()
        statement = await conn.prepare(sql)
        for i in range(0, len(rows), WRITE_BATCH):
            async with conn.transaction():
                await statement.executemany(
                    [tuple(r[c] for c in columns) for r in rows[i : i + WRITE_BATCH]]
                )
        return len(rows) / (time.perf_counter() - start)
    finally:
        await conn.close()


async def _settlement(
    urls: dict[str, str], sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    identities = _identities(sizes.settle_teams)
    coster = Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)
    out: dict[str, Any] = {}
    for backend, url in urls.items():
        progress(f"settlement: {backend}")
        ledger = await _prepare(url, identities)
        writes: list[float] = []
        cpu: dict[str, list[float]] = {"1": [], str(WRITE_BATCH): []}
        raw_writes: list[float] = []
        settles: dict[int, list[float]] = {b: [] for b in sizes.settle_batches}
        try:
            for _ in range(repeats):
                for size in cpu:
                    n = sizes.settle_records // 10 if size == "1" else sizes.settle_records
                    records = _records(n, identities, datetime.now(UTC))
                    cpu[size].append(await _write_cpu(ledger, records, int(size)))
                await SettlementWorker(ledger, None, coster, CODEC).run_once()
                if backend == "postgresql":
                    records = _records(sizes.settle_records, identities, datetime.now(UTC))
                    raw_writes.append(await _executemany(ledger, url, records))
                    await SettlementWorker(ledger, None, coster, CODEC).run_once()
                for batch in sizes.settle_batches:
                    n = max(sizes.settle_records, batch)
                    records = _records(n, identities, datetime.now(UTC))
                    writes.append(n / await _write(ledger, records))
                    worker = SettlementWorker(ledger, None, coster, CODEC, batch_size=batch)
                    start = time.perf_counter()
                    result = await worker.run_once()
                    elapsed = time.perf_counter() - start
                    if result.settled != n:
                        raise RuntimeError(f"settled {result.settled} of {n} records")
                    settles[batch].append(n / elapsed)
        finally:
            await ledger.disconnect()
        out[backend] = {
            "record_writes_per_s": summary(writes),
            "record_write_cpu_us": {f"batch {b}": summary(v) for b, v in cpu.items()},
            "settle_records_per_s": {str(b): summary(v) for b, v in settles.items()},
        }
        if raw_writes:
            out[backend]["executemany_writes_per_s"] = summary(raw_writes)
    return out


def _race_worker(url: str, batch: int, ready: Any, start: Any, results: Any) -> None:
    """One worker process of a race: settle until a pass finds nothing left, then report
    (records settled, CPU seconds, when it finished)."""

    async def run() -> None:
        ledger = Ledger(url)
        await ledger.connect()
        coster = Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)
        worker = SettlementWorker(ledger, None, coster, CODEC, batch_size=batch)
        ready.release()
        await asyncio.to_thread(start.wait)
        settled, cpu = 0, time.process_time()
        while done := (await worker.run_once()).settled:
            settled += done
        results.put((settled, time.process_time() - cpu, time.time()))
        await ledger.disconnect()

    asyncio.run(run())


def _race(url: str, workers: int, batch: int) -> tuple[float, float, int]:
    """Start ``workers`` processes on the unsettled records of ``url``; returns (records/s,
    their CPU µs per record, records settled)."""
    ctx = multiprocessing.get_context("spawn")  # no event loop or pool inherited
    ready, start, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(url, batch, ready, start, results))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:  # every worker connected: the clock starts for all at once
            _wait(lambda: ready.acquire(timeout=0.5), procs, 120, "start")
        began = time.time()
        start.set()
        reports = [_wait(lambda: _get(results), procs, 600, "finish") for _ in procs]
    finally:
        for proc in procs:  # a failed run must not leave workers behind (or hang the exit)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    settled = sum(r[0] for r in reports)
    elapsed = max(r[2] for r in reports) - began
    return settled / elapsed, sum(r[1] for r in reports) / max(1, settled) * 1e6, settled


def _get(queue: Any) -> Any:
    try:
        return queue.get(timeout=0.5)
    except Empty:
        return None


def _wait(poll: Callable[[], Any], procs: list[Any], seconds: float, what: str) -> Any:
    """Poll until ``poll()`` answers, failing early when a worker process died."""
    deadline = time.monotonic() + seconds
    while not (answer := poll()):
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a settlement worker process did not {what}")
    return answer


async def _races(
    url: str, sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    identities = _identities(sizes.settle_teams)
    coster = Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)
    ledger = await _prepare(url, identities)
    out: dict[str, Any] = {}
    try:
        await SettlementWorker(ledger, None, coster, CODEC).run_once()  # nothing left over
        for workers in sizes.settle_workers:
            progress(f"settlement: {workers} PostgreSQL workers racing")
            rates: list[float] = []
            cpu: list[float] = []
            for _ in range(repeats):
                records = _records(sizes.settle_race_records, identities, datetime.now(UTC))
                await _write(ledger, records)
                before = await ledger.charges_total()
                rate, cpu_us, settled = await asyncio.to_thread(
                    _race, url, workers, sizes.settle_race_batch
                )
                charged = await ledger.charges_total() - before
                expected = sum(coster.cost(r.model, r.usage) for r in records)
                if settled != len(records) or charged != expected:
                    raise RuntimeError(
                        f"{workers} workers settled {settled} of {len(records)} records and "
                        f"charged {charged} of {expected} micro-USD"
                    )
                rates.append(rate)
                cpu.append(cpu_us)
            out[str(workers)] = {"records_per_s": summary(rates), "cpu_us_per_record": summary(cpu)}
    finally:
        await ledger.disconnect()
    return out


async def _preflight_load(
    store: RedisStore, identity: Identity, calls: int, concurrency: int
) -> list[int]:
    keys = CODEC.plan(identity, datetime.now(UTC))
    samples: list[int] = []
    clock = time.perf_counter_ns

    async def worker(n: int) -> None:
        for _ in range(n):
            start = clock()
            await store.preflight(keys)
            samples.append(clock() - start)

    per = max(1, calls // concurrency)
    await asyncio.gather(*(worker(per) for _ in range(concurrency)))
    return samples


async def warm_preflight_keys(store: RedisStore, identity: Identity) -> None:
    keys = CODEC.plan(identity, datetime.now(UTC))
    policies = [
        Policy(c.target, HIGH_LIMIT_MICROS, "bench")
        for c in keys.checks
        if isinstance(c.target, Limit)
    ]
    await store.fill(keys, CODEC.policy_fields(policies, balance=False), [], policy_ttl=3600)
    fills = [UsageFill(c.usage_key, 0, c.expires_at) for c in keys.checks]
    await store.fill(keys, None, fills, policy_ttl=3600)


async def _preflight(
    redis_url: str, pg_url: str, sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    progress("settlement: Redis preflight under load")
    store = RedisStore.from_url(redis_url, timeout=5.0)
    identities = _identities(sizes.settle_teams)
    coster = Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)
    ledger = await _prepare(pg_url, identities)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        # Not one of the settling teams: the pass evicts their (just written) policies.
        probe = Identity("probe", "key")
        await warm_preflight_keys(store, probe)
        # Warm-up: the pool opens its connections and registers the script now.
        await _preflight_load(store, probe, 640, 64)
        for _ in range(repeats):
            for conc in sizes.preflight_concurrency:
                samples = await _preflight_load(store, probe, sizes.preflight_calls, conc)
                _add(results, f"concurrency {conc}", samples)
            # The in-app worker settling and refreshing the cache in the same event loop.
            await _write(ledger, _records(sizes.settle_records, identities, datetime.now(UTC)))
            worker = SettlementWorker(ledger, store, coster, CODEC)
            settle = asyncio.create_task(worker.run_once())
            samples = []
            while not settle.done():
                samples += await _preflight_load(store, probe, 64 * 4, 64)
            await settle
            _add(results, "concurrency 64, settlement running", samples)
    finally:
        await ledger.disconnect()
        await store.aclose()
    return {
        label: {stat: summary(values) for stat, values in stats.items()}
        for label, stats in results.items()
    }


def _add(results: dict[str, dict[str, list[float]]], label: str, samples: list[int]) -> None:
    entry = results.setdefault(label, {"p50_us": [], "p99_us": [], "calls": []})
    entry["p50_us"].append(percentile(samples, 50) / 1000)
    entry["p99_us"].append(percentile(samples, 99) / 1000)
    entry["calls"].append(float(len(samples)))


def measure(
    sqlite_url: str,
    pg_url: str,
    redis_url: str,
    sizes: Sizes,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    settle = asyncio.run(
        _settlement({"sqlite": sqlite_url, "postgresql": pg_url}, sizes, repeats, progress)
    )
    races = asyncio.run(_races(pg_url, sizes, repeats, progress))
    preflight = asyncio.run(_preflight(redis_url, pg_url, sizes, repeats, progress))
    return {"backends": settle, "postgresql_workers": races, "redis_preflight": preflight}
