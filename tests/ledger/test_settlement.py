"""Tests for spendguard.ledger.settlement: charges land in the periods of t0, once, and only
in the aggregates of limits that have a policy."""

from __future__ import annotations

import pytest
from sqlalchemy.sql.compiler import Compiled

from spendguard.ledger import Account, Aggregate, Ledger, SettledRecord
from spendguard.ledger.schema import charges
from spendguard.limits import Balance, Limit, Period, Subject
from spendguard.record import PostflightStatus
from tests.ledger.helpers import ACME, ALPHA, OCT1, SEP30_LATE, set_policy
from tests.support import make_record, sql_execute, unit_price

pytestmark = pytest.mark.anyio


async def test_settlement_lands_in_t0_periods_and_only_policy_scopes(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000)
    await set_policy(ledger, Period.MONTH, 1_000, key=None)
    await ledger.insert_records([make_record("late", SEP30_LATE, 7), make_record("next", OCT1, 11)])
    done = await ledger.settle(100, unit_price, now=OCT1)
    assert done.charged == 2 and done.total_micros == 18
    # 23:59:59.999 on Sep 30, settled on Oct 1 → Sep 30 and September; no api_key month policy.
    assert set(await ledger.aggregates("acme")) == {
        Aggregate(Limit(ALPHA, Period.DAY), "20260930", 7),
        Aggregate(Limit(ALPHA, Period.DAY), "20261001", 11),
        Aggregate(Limit(ACME, Period.MONTH), "202609", 7),
        Aggregate(Limit(ACME, Period.MONTH), "202610", 11),
    }
    assert await ledger.aggregates("other") == []
    assert len(await ledger.aggregates()) == 4
    assert await ledger.unsettled() == (0, 0)
    assert (await ledger.settle(100, unit_price, now=OCT1)).charged == 0  # nothing twice
    assert await ledger.charges_total("acme") == 18
    assert await ledger.charges_total() == 18


async def test_one_update_per_aggregate_row_sums_a_batch(ledger: Ledger) -> None:
    await set_policy(ledger, Period.MONTH, 10**12, key=None, now=OCT1)
    await ledger.insert_records([make_record(f"r{i}", OCT1, i) for i in range(1, 301)])
    done = await ledger.settle(1000, unit_price, now=OCT1)
    assert done.charged == 300
    assert await ledger.aggregates("acme") == [
        Aggregate(Limit(ACME, Period.MONTH), "202610", sum(range(1, 301)))
    ]


async def test_settled_records_say_what_they_count_toward(ledger: Ledger) -> None:
    await ledger.insert_records(
        [
            make_record("late", SEP30_LATE, 7),
            make_record("lost", OCT1, 11, key="beta", postflight=PostflightStatus.UNKNOWN),
            make_record("bare", OCT1, 1, key=None),
        ]
    )
    done = await ledger.settle(100, unit_price, now=OCT1)
    from_batch = {r.id: r for r in done.records["acme"]}
    from_charges = await ledger.settled_records(["late", "lost", "bare", "never", "late"])
    assert from_charges == from_batch  # the same answer, now or on a later pass
    assert from_charges["late"] == SettledRecord("late", "acme", "alpha", SEP30_LATE, False)
    assert from_charges["lost"].unknown and not from_charges["bare"].unknown
    assert from_charges["bare"].api_key is None

    late, lost, bare = from_charges["late"], from_charges["lost"], from_charges["bare"]
    # A balance takes every record of its team.
    assert all(r.counts_toward(Balance("acme"), "") for r in (late, lost, bare))
    assert not late.counts_toward(Balance("other"), "")
    # A team limit: every key of the team, in the bucket of the record's t0.
    assert late.counts_toward(Limit(ACME, Period.DAY), "20260930")
    assert not late.counts_toward(Limit(ACME, Period.DAY), "20261001")  # settled Oct 1
    assert late.counts_toward(Limit(ACME, Period.MONTH), "202609")
    assert bare.counts_toward(Limit(ACME, Period.MONTH), "202610")
    assert not late.counts_toward(Limit(Subject("other"), Period.DAY), "20260930")
    # A key limit: only that key's records.
    assert late.counts_toward(Limit(ALPHA, Period.DAY), "20260930")
    assert not lost.counts_toward(Limit(ALPHA, Period.DAY), "20261001")
    assert lost.counts_toward(Limit(Subject("acme", "beta"), Period.MONTH), "202610")
    assert not bare.counts_toward(Limit(ALPHA, Period.MONTH), "202610")


async def test_a_record_already_charged_is_settled_but_not_charged_again(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 10**6, now=OCT1)
    await ledger.topup(team="acme", team_id="acme", micros=1_000, now=OCT1)
    await ledger.insert_records([make_record("dup", OCT1, 7), make_record("new", OCT1, 5)])
    # A charge without its settled flag: no spendguard path leaves this (both commit together),
    # but the charge must still stay the record's only one, counted once.
    await sql_execute(
        ledger.url,
        charges.insert().values(
            record_id="dup",
            team="acme",
            api_key="alpha",
            model="m",
            day_id="20261001",
            month_id="202610",
            amount_micros=7,
            settled_us=0,
        ),
    )
    done = await ledger.settle(100, unit_price, now=OCT1)
    assert (done.claimed, done.charged, done.total_micros) == (2, 1, 5)
    assert {r.id for r in done.records["acme"]} == {"dup", "new"}  # both leave the cache
    assert await ledger.unsettled() == (0, 0)
    assert await ledger.charges_total() == 12
    assert await ledger.aggregates("acme") == [Aggregate(Limit(ALPHA, Period.DAY), "20261001", 5)]
    assert await ledger.load_balance("acme") == Account("acme", 1_000, 5)


async def test_a_batch_compiles_no_statement(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    await set_policy(ledger, Period.DAY, 10**6, now=OCT1)
    await set_policy(ledger, Period.MONTH, 10**6, key=None, now=OCT1)
    await ledger.topup(team="acme", team_id="acme", micros=1_000, now=OCT1)
    await ledger.insert_records([make_record(f"r{i}", OCT1, i) for i in range(1, 51)])
    compiled: list[str] = []
    compile_statement = Compiled.__init__

    def counting(self: Compiled, *args: object, **kwargs: object) -> None:
        compiled.append(type(self).__name__)
        compile_statement(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Compiled, "__init__", counting)
    done = await ledger.settle(100, unit_price, now=OCT1)
    monkeypatch.undo()
    assert done.charged == 50 and compiled == []
    assert await ledger.charges_total() == sum(range(1, 51))
