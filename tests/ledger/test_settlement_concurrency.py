"""Settlement under concurrency on PostgreSQL: several workers, policies changing mid-period."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import anyio
import pytest
import sqlalchemy as sa

from spendguard.ledger import Account, Aggregate, Ledger
from spendguard.ledger.schema import charges
from spendguard.limits import Limit, Period, Policy, Subject
from spendguard.record import InferenceRecord
from tests.support import charges_in_month, make_record, sql_rows, unit_price

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 11, 10, 12, tzinfo=UTC)


def rec(i: int, team: str) -> InferenceRecord:
    return make_record(f"r{i}", T0 + timedelta(seconds=i), 1 + i % 97, team=team, key=f"k{i % 3}")


def spread(i: int, team: str) -> InferenceRecord:
    """Like ``rec``, over two UTC days."""
    t0 = T0 + timedelta(seconds=15 * i)
    return make_record(f"r{i}", t0, 1 + i % 97, team=team, key=f"k{i % 3}")


async def test_policy_added_mid_period_while_traffic_and_workers_run(
    clean_postgres_url: str,
) -> None:
    ledgers = [Ledger(clean_postgres_url) for _ in range(4)]  # separate pools: real concurrency
    for led in ledgers:
        await led.connect()
    await ledgers[0].init_schema()
    producer, workers = ledgers[0], ledgers[1:]
    teams = [f"t{n}" for n in range(5)]
    total_records = 3000
    done = anyio.Event()
    settled = 0

    async def produce() -> None:
        rng = random.Random(7)
        for start in range(0, total_records, 100):
            await producer.insert_records(
                [rec(i, rng.choice(teams)) for i in range(start, start + 100)]
            )
            await anyio.sleep(0.005)
        done.set()

    async def settle(led: Ledger) -> None:
        nonlocal settled
        while True:
            batch = await led.settle(97, unit_price, now=T0)
            settled += batch.charged
            if not batch.charged:
                if done.is_set() and (await led.unsettled())[0] == 0:
                    return
                await anyio.sleep(0.002)

    async def change_policies() -> None:
        await anyio.sleep(0.05)  # traffic and settlement are under way
        for team in teams:
            limit = Limit(Subject(team), Period.MONTH)
            await producer.set_policy(Policy(limit, 10**12, team_id=team), now=T0)
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        tg.start_soon(change_policies)
        for led in workers:
            tg.start_soon(settle, led)

    assert settled == total_records  # every record settled once, none lost, none twice
    assert await producer.charges_total() == sum(1 + i % 97 for i in range(total_records))
    for team in teams:
        # Folded in exactly once, whichever side of each settlement the activation fell on.
        limit = Limit(Subject(team), Period.MONTH)
        expected = Aggregate(
            limit, "202611", await charges_in_month(clean_postgres_url, team, "202611")
        )
        assert await producer.aggregates(team) == [expected]
        assert (await producer.policy_aggregates(T0, [team]))[team] == [expected]
    for led in ledgers:
        await led.disconnect()


async def test_workers_racing_over_the_same_records_charge_each_once(
    clean_postgres_url: str,
) -> None:
    ledgers = [Ledger(clean_postgres_url) for _ in range(5)]  # separate pools: real concurrency
    for led in ledgers:
        await led.connect()
    await ledgers[0].init_schema()
    producer, workers = ledgers[0], ledgers[1:]
    teams = [f"t{n}" for n in range(4)]
    for team in teams:
        await producer.set_policy(Policy(Limit(Subject(team), Period.MONTH), 10**12, team), now=T0)
        for key in ("k0", "k1"):  # k2 spends without a key limit
            limit = Limit(Subject(team, key), Period.DAY)
            await producer.set_policy(Policy(limit, 10**12, team, key), now=T0)
    for team in teams[:3]:
        await producer.topup(team=team, team_id=team, micros=10**9, now=T0)
    # Settled before t3's account opened: never debited from it.
    early = [spread(i, "t3") for i in range(100)]
    await producer.insert_records(early)
    assert (await producer.settle(1000, unit_price, now=T0)).charged == len(early)
    await producer.topup(team="t3", team_id="t3", micros=10**9, now=T0)
    rng = random.Random(11)
    later = [spread(i, rng.choice(teams)) for i in range(100, 4100)]
    await producer.insert_records(later)
    counts: list[int] = []

    async def settle(led: Ledger) -> None:
        while (batch := await led.settle(97, unit_price, now=T0)).claimed:
            counts.append(batch.charged)

    async with anyio.create_task_group() as tg:
        for led in workers:
            tg.start_soon(settle, led)

    assert sum(counts) == len(later)  # every record settled once, none lost, none twice
    assert await producer.unsettled() == (0, 0)
    price = {r.id: r.usage.input_tokens for r in early + later}
    assert await producer.charges_total() == sum(price.values())
    rows = await sql_rows(
        clean_postgres_url,
        sa.select(charges.c.record_id, charges.c.team, charges.c.api_key, charges.c.amount_micros),
    )
    assert sorted(r[0] for r in rows) == sorted(price)
    assert all(amount == price[rid] for rid, _, _, amount in rows)
    for team in teams:
        spent = sum(price[r.id] for r in later if r.identity.team == team)
        assert (await producer.load_balance(team)) == Account(team, 10**9, spent)
        expected = {
            Aggregate(
                Limit(Subject(team), Period.MONTH),
                "202611",
                await charges_in_month(clean_postgres_url, team, "202611"),
            )
        }
        days = {Period.DAY.bucket(r.t0) for r in early + later}
        assert days == {"20261110", "20261111"}
        for key in ("k0", "k1"):
            for day in days:
                total = sum(
                    price[r.id]
                    for r in early + later
                    if r.identity.team == team
                    and r.identity.api_key == key
                    and Period.DAY.bucket(r.t0) == day
                )
                if total:
                    expected.add(Aggregate(Limit(Subject(team, key), Period.DAY), day, total))
        assert set(await producer.aggregates(team)) == expected
    for led in ledgers:
        await led.disconnect()
