"""The SQL ledger against real SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.identity import Identity
from spendguard.ledger import Ledger, RecordRow
from spendguard.periods import Period
from spendguard.record import InferenceRecord, PostflightStatus
from spendguard.usage import Usage

pytestmark = pytest.mark.anyio

SEP30_LATE = datetime(2026, 9, 30, 23, 59, 59, 999000, tzinfo=UTC)
OCT1 = datetime(2026, 10, 1, 0, 0, 5, tzinfo=UTC)


def record(
    rid: str, t0: datetime, tokens: int, team: str = "acme", key: str = "alpha"
) -> InferenceRecord:
    return InferenceRecord(
        id=rid,
        inference_id=rid,
        identity=Identity(team, key),
        model="m",
        route="/v1/chat/completions",
        t0=t0,
        status_code=200,
        usage=Usage(input_tokens=tokens),
        estimate_micros=tokens,
        postflight=PostflightStatus.APPLIED,
    )


def price(rec: RecordRow) -> int:
    return rec.input_tokens  # one micro-USD per token keeps expectations obvious


async def set_policy(
    led: Ledger, period: Period, limit: int, key: str | None = "alpha", now: datetime = SEP30_LATE
) -> None:
    ident = Identity("acme", key)
    await led.set_policy(
        team=ident.team,
        team_id="acme",
        api_key=ident.api_key,
        api_key_id=key,
        period=period,
        limit_micros=limit,
        now=now,
    )


async def test_schema_init_is_idempotent(ledger: Ledger) -> None:
    await ledger.init_schema()
    await ledger.init_schema()
    assert await ledger.list_policies() == []


async def test_policy_set_change_list_remove(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 5_000_000)
    await set_policy(ledger, Period.DAY, 7_000_000)  # change keeps one row
    await set_policy(ledger, Period.MONTH, 100_000_000, key=None)
    rows = await ledger.list_policies("acme")
    assert {(r.api_key, r.period, r.limit_micros) for r in rows} == {
        ("alpha", Period.DAY, 7_000_000),
        (None, Period.MONTH, 100_000_000),
    }
    assert await ledger.load_policies("acme") == {
        "api_key:alpha:day": 7_000_000,
        "team:month": 100_000_000,
    }
    assert await ledger.remove_policy(team="acme", api_key="alpha", period=Period.DAY)
    assert not await ledger.remove_policy(team="acme", api_key="alpha", period=Period.DAY)
    assert await ledger.load_policies("acme") == {"team:month": 100_000_000}


async def test_records_are_written_once(ledger: Ledger) -> None:
    rec = record("r1", SEP30_LATE, 10)
    await ledger.insert_records([rec])
    await ledger.insert_records([rec])  # a re-send after an unknown outcome
    assert await ledger.unsettled() == (1, 10)


async def test_settlement_lands_in_t0_periods_and_only_policy_scopes(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000)
    await set_policy(ledger, Period.MONTH, 1_000, key=None)
    await ledger.insert_records([record("late", SEP30_LATE, 7), record("next", OCT1, 11)])
    done = await ledger.settle(100, price, now=OCT1)
    assert done.charged == 2 and done.total_micros == 18
    aggs = {
        (r["api_key"], r["period"], r["period_id"]): r["settled_micros"]
        for r in await ledger.aggregate_rows("acme")
    }
    # 23:59:59.999 on Sep 30, settled on Oct 1 → Sep 30 and September; no api_key month policy.
    assert aggs == {
        ("alpha", "day", "20260930"): 7,
        ("alpha", "day", "20261001"): 11,
        ("", "month", "202609"): 7,
        ("", "month", "202610"): 11,
    }
    assert await ledger.unsettled() == (0, 0)
    assert (await ledger.settle(100, price, now=OCT1)).charged == 0  # nothing twice
    assert await ledger.charges_total("acme") == 18


async def test_one_update_per_aggregate_row_sums_a_batch(ledger: Ledger) -> None:
    await set_policy(ledger, Period.MONTH, 10**12, key=None, now=OCT1)
    await ledger.insert_records([record(f"r{i}", OCT1, i) for i in range(1, 301)])
    done = await ledger.settle(1000, price, now=OCT1)
    assert done.charged == 300
    [agg] = await ledger.aggregate_rows("acme")
    assert agg["settled_micros"] == sum(range(1, 301))


async def test_new_policy_folds_in_the_periods_existing_charges(ledger: Ledger) -> None:
    await ledger.insert_records([record("a", OCT1, 40), record("b", OCT1, 2)])
    await ledger.settle(100, price, now=OCT1)  # no policy yet: charges, no aggregates
    assert await ledger.aggregate_rows("acme") == []
    await set_policy(ledger, Period.DAY, 1_000, now=OCT1)
    loaded = await ledger.load_aggregates("acme", [("alpha", Period.DAY, "20261001")])
    assert loaded == {("alpha", Period.DAY, "20261001"): 42}
    await set_policy(ledger, Period.DAY, 2_000, now=OCT1)  # amount change keeps the aggregate
    await ledger.insert_records([record("c", OCT1, 8)])
    await ledger.settle(100, price, now=OCT1)
    loaded = await ledger.load_aggregates("acme", [("alpha", Period.DAY, "20261001")])
    assert loaded == {("alpha", Period.DAY, "20261001"): 50}


async def test_removed_policy_stops_counting(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000, now=OCT1)
    await ledger.insert_records([record("a", OCT1, 5)])
    await ledger.settle(100, price, now=OCT1)
    await ledger.remove_policy(team="acme", api_key="alpha", period=Period.DAY)
    await ledger.insert_records([record("b", OCT1, 6)])
    await ledger.settle(100, price, now=OCT1)
    loaded = await ledger.load_aggregates("acme", [("alpha", Period.DAY, "20261001")])
    assert loaded == {("alpha", Period.DAY, "20261001"): 5}
    assert await ledger.charges_total("acme") == 11


async def test_missing_aggregate_loads_as_zero(ledger: Ledger) -> None:
    got = await ledger.load_aggregates("nobody", [(None, Period.MONTH, "202610")])
    assert got == {(None, Period.MONTH, "202610"): 0}


async def test_unreachable_database_raises_ledger_unavailable() -> None:
    from spendguard.errors import LedgerUnavailable

    led = Ledger("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(LedgerUnavailable):
        await led.connect()


async def test_settlement_debits_balances_in_the_same_transaction(ledger: Ledger) -> None:
    assert await ledger.load_policies("acme") == {}
    await ledger.topup(team="acme", team_id="acme", micros=1_000)
    assert await ledger.load_policies("acme") == {"balance": 1}  # the cache's account marker
    await ledger.insert_records(
        [record("a", OCT1, 7), record("b", OCT1, 8), record("c", OCT1, 9, team="other")]
    )
    await ledger.settle(100, price, now=OCT1)
    assert await ledger.load_balance("acme") == (1_000, 15)
    assert await ledger.load_balance("other") is None  # no account: not debited, not created
    await ledger.topup(team="acme", team_id="acme", micros=500)
    assert await ledger.load_balance("acme") == (1_500, 15)
    assert await ledger.topups_total("acme") == 1_500
