"""At scale: 3 worker processes and 2 gateway processes on PostgreSQL and
Redis, 4,000 records across 50 teams, half before and half after a UTC midnight that is also a
month end.

After quiescence: every aggregate equals an independent SQL recomputation from the charges,
every cached value of the current periods equals its aggregate (closed periods are updated in
the ledger only), and every balance equals top-ups minus charges.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import sqlalchemy as sa
from databases import Database

from spendguard.ledger import Ledger
from spendguard.ledger.schema import aggregates, charges, policies, records
from spendguard.limits import Balance, KeyCodec, Limit, Period, Policy, Subject, window_of
from spendguard.store.redis import RedisStore
from tests.support import clean_env, free_port, spawn, stop, topups_total, uvicorn

# Half the records are sent before the midnight 40 s after T0 and half after it: the traffic
# waits for midnight in between, so the run crosses it however fast the machine is (it used to
# rely on 12,000 records taking long enough, 5 minutes and more on a loaded 2-core machine).
# 4,000 still keep 32 clients busy on both gateways, and the three workers racing over the
# batches, for tens of seconds on each side of midnight; set more to load it harder.
RECORDS = int(os.environ.get("SPENDGUARD_TEST_SCALE_RECORDS", "4000"))
TEAMS = [f"team{n:02d}" for n in range(50)]
# 40 s before the end of November 30th, UTC: the run crosses midnight and the month end. The
# clock starts when the processes are spawned; on a loaded machine starting them and setting up
# the policies can take a while, and the traffic must still begin before midnight.
T0 = datetime(2026, 11, 30, 23, 59, 20, tzinfo=UTC)
MIDNIGHT = datetime(2026, 12, 1, tzinfo=UTC)


def _injected_now(env: dict[str, str]) -> datetime:
    """What the processes' injected clock reads now (tests.system.scale_app)."""
    return T0 + timedelta(seconds=time.time() - float(env["SCALE_REF"]))


def _grace_to_now() -> str:
    """Redis decides whether a usage key's period is closed (its end plus the grace) on its
    own, real clock: the grace must reach from the injected periods to the real time, as it did
    when the run's date was near (the default two days beyond that)."""
    behind = (datetime.now(UTC) - T0).total_seconds()
    return str(max(0.0, behind) + 172_800.0)


@pytest.fixture
def env(clean_postgres_url: str, redis_url: str) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_DATABASE_URL=clean_postgres_url,
        SPENDGUARD_REDIS_URL=redis_url,
        SPENDGUARD_RUN_WORKER="false",  # the gateways only sync; three workers settle
        SPENDGUARD_SETTLE_INTERVAL="0.5",
        SPENDGUARD_REDIS_TIMEOUT="2",
        SPENDGUARD_POLICY_TTL="5",
        SPENDGUARD_KEY_GRACE=_grace_to_now(),
        SCALE_T0=T0.isoformat(),
        SCALE_REF=str(time.time()),
    )


@pytest.fixture
def fleet(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[list[str], list[Any]]]:
    gateways, bases, workers = [], [], []
    try:
        for n in range(2):
            port = free_port()
            options = ["--factory", "--log-level", "warning", "--timeout-keep-alive", "300"]
            app, log = "tests.system.scale_app:make_app", tmp_path / f"gw{n}.log"
            gateways.append(uvicorn(app, port, env, log, *options))
            bases.append(f"http://127.0.0.1:{port}")
        for n in range(3):
            workers.append(spawn(["-m", "tests.system.scale_app"], env, tmp_path / f"w{n}.log"))
        deadline = time.monotonic() + 30
        for base, n in zip(bases, range(2), strict=True):
            while True:
                try:
                    if httpx.post(f"{base}/v1/models", timeout=1).status_code < 500:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / f"gw{n}.log").read_text()
                time.sleep(0.1)
        yield bases, [gateways, workers]
    finally:
        stop(gateways + workers)


async def _setup(ledger: Ledger) -> None:
    for n, team in enumerate(TEAMS):
        month = Limit(Subject(team), Period.MONTH)
        await ledger.set_policy(Policy(month, 10**12, team), now=T0)
        day = Limit(Subject(team, "k0"), Period.DAY)
        await ledger.set_policy(Policy(day, 10**12, team, "k0"), now=T0)
        if n % 2 == 0:
            await ledger.topup(team=team, team_id=team, micros=10**12)


async def _traffic(bases: list[str], jobs: list[tuple[str, str, int]]) -> int:
    ok = 0
    failures: list[tuple[int, str]] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:

        async def worker(share: list[tuple[str, str, int]]) -> None:
            nonlocal ok
            for team, key, i in share:
                body: dict[str, Any] = {
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "x" * (i % 50)}],
                }
                if i % 4 == 1:
                    body.update(stream=True, stream_options={"include_usage": True})
                r = await client.post(
                    f"{bases[i % 2]}/v1/chat/completions",
                    json=body,
                    headers={"x-test-team": team, "x-test-key": key},
                )
                ok += r.status_code == 200
                if r.status_code != 200:
                    failures.append((r.status_code, r.text[:200]))

        async with anyio.create_task_group() as tg:
            for n in range(32):
                tg.start_soon(worker, jobs[n::32])
    assert not failures, failures[:5]
    return ok


async def _traffic_across_midnight(bases: list[str], env: dict[str, str]) -> int:
    """Half the records before MIDNIGHT on the injected clock, the other half after it."""
    rng = random.Random(11)
    jobs = [(rng.choice(TEAMS), f"k{rng.randrange(3)}", i) for i in range(RECORDS)]
    # Setting up the fleet and the policies must leave the first half its side of midnight.
    assert _injected_now(env) < MIDNIGHT, "the traffic began after midnight: setup too slow"
    ok = await _traffic(bases, jobs[: RECORDS // 2])
    await anyio.sleep(max(0.0, (MIDNIGHT - _injected_now(env)).total_seconds()) + 0.5)
    return ok + await _traffic(bases, jobs[RECORDS // 2 :])


@pytest.mark.timeout(600)  # 1-3 minutes on a loaded 2-core machine
def test_three_workers_two_gateways_across_midnight_and_month_end(
    fleet: tuple[list[str], list[Any]], env: dict[str, str]
) -> None:
    bases, (gateways, _workers) = fleet
    url = env["SPENDGUARD_DATABASE_URL"]

    async def run() -> None:
        ledger = Ledger(url)
        await ledger.connect()
        await _setup(ledger)
        assert await _traffic_across_midnight(bases, env) == RECORDS
        for proc in gateways:  # graceful: each flushes its record buffer
            proc.terminate()
        for proc in gateways:
            proc.wait(timeout=30)
        db = Database(url)  # an independent connection: the checks below bypass the ledger
        await db.connect()
        with anyio.fail_after(120):  # the three workers drain the ledger
            while (await ledger.unsettled())[0]:
                await anyio.sleep(0.2)
        n_records = await db.fetch_val(sa.select(sa.func.count()).select_from(records))
        n_charges = await db.fetch_val(sa.select(sa.func.count()).select_from(charges))
        assert n_records == n_charges == RECORDS  # none lost, none charged twice
        days = {r[0] for r in await db.fetch_all(sa.select(charges.c.day_id).distinct())}
        months = {r[0] for r in await db.fetch_all(sa.select(charges.c.month_id).distinct())}
        assert {"20261130", "20261201"} <= days and months == {"202611", "202612"}

        # Every aggregate == an independent recomputation from the charges.
        stored = {
            (r[0], r[1], r[2], r[3]): int(r[4])
            for r in await db.fetch_all(
                sa.select(
                    aggregates.c.team,
                    aggregates.c.api_key,
                    aggregates.c.period,
                    aggregates.c.period_id,
                    aggregates.c.settled_micros,
                )
            )
        }
        pol = await db.fetch_all(sa.select(policies.c.team, policies.c.api_key, policies.c.period))
        recomputed: dict[tuple[str, str, str, str], int] = {}
        for team, key, period in (tuple(r._mapping.values()) for r in pol):
            column = charges.c.day_id if period == "day" else charges.c.month_id
            conds = [charges.c.team == team] + ([charges.c.api_key == key] if key else [])
            for row in await db.fetch_all(
                sa.select(column, sa.func.sum(charges.c.amount_micros))
                .where(*conds)
                .group_by(column)
            ):
                recomputed[(team, key, period, row[0])] = int(row[1])
        assert {k: v for k, v in stored.items() if v} == recomputed

        # Every cached value of the current periods == its aggregate; balances add up.
        store = RedisStore.from_url(env["SPENDGUARD_REDIS_URL"], timeout=2)
        await anyio.sleep(1.5)  # the workers' sync passes after the last settlement
        checked = 0
        codec = KeyCodec("quota", timedelta(days=2))
        for (team, key, period, pid), value in recomputed.items():
            if pid not in ("20261201", "202612"):
                continue
            limit = Limit(Subject(team, key or None), window_of(period))
            k = codec.usage_key(limit, pid)
            cached = (await store.read_usage([k]))[k]
            if cached is not None:
                assert cached == value, (limit, pid)
                checked += 1
        assert checked > 0
        for n, team in enumerate(TEAMS):
            account = await ledger.load_balance(team)
            if n % 2:
                assert account is None
                continue
            assert account is not None
            assert account.balance == (
                await topups_total(url, team) - await ledger.charges_total(team)
            )
            k = codec.usage_key(Balance(team), "")
            cached = (await store.read_usage([k]))[k]
            assert cached in (None, account.charged)
        await store.aclose()
        await db.disconnect()
        await ledger.disconnect()

    anyio.run(run)
