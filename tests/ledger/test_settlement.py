"""Tests for spendguard.ledger.settlement: charges land in the periods of t0, once, and only
in the aggregates of limits that have a policy."""

from __future__ import annotations

import pytest

from spendguard.ledger import Aggregate, Ledger, SettledRecord
from spendguard.limits import Balance, Limit, Period, Subject
from spendguard.record import PostflightStatus
from tests.ledger.helpers import ACME, ALPHA, OCT1, SEP30_LATE, set_policy
from tests.support import make_record, unit_price

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
