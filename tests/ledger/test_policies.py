"""Tests for spendguard.ledger.policies: policies set, changed and removed; what a cache miss
loads; the aggregates of active limits."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from spendguard.ledger import Account, Aggregate, Ledger
from spendguard.ledger.schema import rates as rates_table
from spendguard.limits import Limit, Period, Policy, Subject
from spendguard.limits.rates import MAX_RATE, Rates
from tests.ledger.helpers import ACME, ALPHA, OCT1, SEP30_LATE, policy, set_policy
from tests.support import make_record, unit_price
from tests.support.sql import sql_execute

pytestmark = pytest.mark.anyio


async def test_policy_set_change_list_remove(ledger: Ledger) -> None:
    assert await set_policy(ledger, Period.DAY, 5_000_000) == policy(Period.DAY, 5_000_000)
    await set_policy(ledger, Period.DAY, 7_000_000)  # change keeps one row
    await set_policy(ledger, Period.MONTH, 100_000_000, key=None)
    assert await ledger.list_policies("acme") == [
        # ordered by team, API key ('' for the team), window
        Policy(Limit(ACME, Period.MONTH), 100_000_000, "acme", None),
        Policy(Limit(ALPHA, Period.DAY), 7_000_000, "acme", "alpha"),
    ]
    assert await ledger.list_policies("other") == []
    assert await ledger.remove_policy(Limit(ALPHA, Period.DAY))
    assert not await ledger.remove_policy(Limit(ALPHA, Period.DAY))
    assert not await ledger.remove_policy(Limit(ALPHA, Period.MONTH))  # never set
    assert await ledger.list_policies() == [
        Policy(Limit(ACME, Period.MONTH), 100_000_000, "acme", None)
    ]
    await set_policy(ledger, Period.DAY, 1_000)  # reactivated, with the new amount
    assert Policy(Limit(ALPHA, Period.DAY), 1_000, "acme", "alpha") in (
        await ledger.list_policies("acme")
    )


async def test_load_limits_is_what_a_cache_miss_needs(ledger: Ledger) -> None:
    assert await ledger.load_limits("acme") == ([], None)  # no policy, no account
    await set_policy(ledger, Period.DAY, 5_000)
    await set_policy(ledger, Period.MONTH, 9_000, key=None)
    await ledger.set_policy(policy(Period.DAY, 1, key=None, team="other"))
    policies, account = await ledger.load_limits("acme")
    assert {(p.limit, p.amount) for p in policies} == {
        (Limit(ALPHA, Period.DAY), 5_000),
        (Limit(ACME, Period.MONTH), 9_000),
    }
    assert account is None
    await ledger.remove_policy(Limit(ALPHA, Period.DAY))
    await ledger.topup(team="acme", team_id="acme", micros=300)
    assert await ledger.load_limits("acme") == (
        [Policy(Limit(ACME, Period.MONTH), 9_000, "acme", None)],
        Account("acme", 300, 0),
    )


async def test_new_policy_folds_in_the_periods_existing_charges(ledger: Ledger) -> None:
    await ledger.insert_records([make_record("a", OCT1, 40), make_record("b", OCT1, 2)])
    await ledger.settle(100, unit_price, now=OCT1)  # no policy yet: charges, no aggregates
    assert await ledger.aggregates("acme") == []
    await set_policy(ledger, Period.DAY, 1_000, now=OCT1)
    wanted = (Limit(ALPHA, Period.DAY), "20261001")
    assert await ledger.load_aggregates("acme", [wanted]) == {wanted: 42}
    await set_policy(ledger, Period.DAY, 2_000, now=OCT1)  # amount change keeps the aggregate
    await ledger.insert_records([make_record("c", OCT1, 8)])
    await ledger.settle(100, unit_price, now=OCT1)
    assert await ledger.load_aggregates("acme", [wanted]) == {wanted: 50}


async def test_removed_policy_stops_counting(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000, now=OCT1)
    await ledger.insert_records([make_record("a", OCT1, 5)])
    await ledger.settle(100, unit_price, now=OCT1)
    await ledger.remove_policy(Limit(ALPHA, Period.DAY))
    await ledger.insert_records([make_record("b", OCT1, 6)])
    await ledger.settle(100, unit_price, now=OCT1)
    wanted = (Limit(ALPHA, Period.DAY), "20261001")
    assert await ledger.load_aggregates("acme", [wanted]) == {wanted: 5}
    assert await ledger.charges_total("acme") == 11


async def test_missing_aggregate_loads_as_zero(ledger: Ledger) -> None:
    wanted = (Limit(Subject("nobody"), Period.MONTH), "202610")
    assert await ledger.load_aggregates("nobody", [wanted]) == {wanted: 0}
    assert await ledger.load_aggregates("nobody", []) == {}


async def test_load_aggregates_reads_several_limits_and_buckets_at_once(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000)
    await set_policy(ledger, Period.MONTH, 1_000, key=None)
    await ledger.insert_records([make_record("late", SEP30_LATE, 7), make_record("next", OCT1, 11)])
    await ledger.settle(100, unit_price, now=OCT1)
    wanted = [
        (Limit(ALPHA, Period.DAY), "20260930"),
        (Limit(ALPHA, Period.DAY), "20261001"),
        (Limit(ACME, Period.MONTH), "202610"),
        (Limit(ACME, Period.DAY), "20261001"),  # no such policy: no row
    ]
    expected = dict(zip(wanted, [7, 11, 11, 0], strict=True))
    assert await ledger.load_aggregates("acme", wanted) == expected
    with pytest.raises(ValueError):  # the team names whose aggregates are read
        await ledger.load_aggregates("other", wanted)


async def test_policy_aggregates_reports_each_active_limits_current_bucket(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000)
    await set_policy(ledger, Period.MONTH, 1_000, key=None)
    await set_policy(ledger, Period.MONTH, 1_000)  # removed below: not reported
    await ledger.set_policy(policy(Period.DAY, 5, key=None, team="other"))
    await ledger.insert_records(
        [
            make_record("late", SEP30_LATE, 7),
            make_record("next", OCT1, 11),
            make_record("o", OCT1, 3, "other"),
        ]
    )
    await ledger.settle(100, unit_price, now=OCT1)
    await ledger.remove_policy(Limit(ALPHA, Period.MONTH))
    await ledger.insert_records([make_record("nokey", OCT1, 2, team="nopolicy", key=None)])
    await ledger.settle(100, unit_price, now=OCT1)

    got = await ledger.policy_aggregates(OCT1)
    assert got.keys() == {"acme", "other"}  # teams with active policies only
    assert set(got["acme"]) == {
        Aggregate(Limit(ALPHA, Period.DAY), "20261001", 11),  # not Sep 30's 7
        Aggregate(Limit(ACME, Period.MONTH), "202610", 11),
    }
    # The "other" team's day limit was set on Sep 30; on Oct 1 its record counted there.
    assert got["other"] == [Aggregate(Limit(Subject("other"), Period.DAY), "20261001", 3)]

    # A window with no aggregate row yet reads as 0; the filter keeps only the asked teams.
    sep30 = await ledger.policy_aggregates(SEP30_LATE, teams=["acme"])
    assert set(sep30) == {"acme"}
    assert set(sep30["acme"]) == {
        Aggregate(Limit(ALPHA, Period.DAY), "20260930", 7),
        Aggregate(Limit(ACME, Period.MONTH), "202609", 7),
    }
    nov = await ledger.policy_aggregates(datetime(2026, 11, 2, tzinfo=UTC), teams=["other"])
    assert nov == {"other": [Aggregate(Limit(Subject("other"), Period.DAY), "20261102", 0)]}
    assert await ledger.policy_aggregates(OCT1, teams=[]) == {}


async def test_policies_changed_since_sees_policies_and_new_accounts(ledger: Ledger) -> None:
    t1 = datetime(2026, 10, 1, tzinfo=UTC)
    t2 = datetime(2026, 10, 2, tzinfo=UTC)
    await set_policy(ledger, Period.DAY, 1, now=t1)
    await ledger.topup(team="rich", team_id="rich", micros=5, now=t2)
    us1, us2 = int(t1.timestamp()) * 10**6, int(t2.timestamp()) * 10**6
    assert await ledger.policies_changed_since(us1) == {"acme": us1, "rich": us2}
    assert await ledger.policies_changed_since(us1 + 1) == {"rich": us2}


async def test_negative_policy_amount_is_refused(ledger: Ledger) -> None:
    with pytest.raises(ValueError):
        await set_policy(ledger, Period.DAY, -1)
    assert await ledger.list_policies() == []


async def test_a_policy_keeps_its_mode_and_a_change_of_mode(ledger: Ledger) -> None:
    hard = Policy(Limit(ALPHA, Period.DAY), 5_000, "acme", "alpha", hard=True)
    await ledger.set_policy(hard, now=SEP30_LATE)
    assert await ledger.list_policies("acme") == [hard]
    await set_policy(ledger, Period.DAY, 5_000)  # set again as soft
    assert [p.hard for p in await ledger.list_policies("acme")] == [False]


async def test_a_database_from_before_modes_gets_the_column_at_start(database_url: str) -> None:
    """A policies table created by an earlier release has no mode column: starting adds it,
    and the policies it held stay soft."""
    from tests.support.sql import sql_execute

    old = Ledger(database_url)
    await old.connect()
    await old.init_schema()
    await old.set_policy(policy(Period.DAY, 5_000), now=SEP30_LATE)
    await old.disconnect()
    await sql_execute(database_url, "ALTER TABLE spendguard_policies DROP COLUMN hard")
    led = Ledger(database_url)
    await led.connect()
    try:
        await led.init_schema()
        await led.init_schema()  # idempotent
        assert await led.list_policies("acme") == [policy(Period.DAY, 5_000)]
        await led.set_policy(
            Policy(Limit(ALPHA, Period.MONTH), 9, "acme", "alpha", hard=True), now=SEP30_LATE
        )
        assert [p.hard for p in await led.list_policies("acme")] == [False, True]  # day, month
    finally:
        await led.disconnect()


async def test_a_policy_keeps_its_alert_thresholds_unless_told(ledger: Ledger) -> None:
    own = Policy(Limit(ALPHA, Period.DAY), 5_000, "acme", "alpha", alert_at=(50, 90))
    assert await ledger.set_policy(own, now=SEP30_LATE) == own
    raised = Policy(Limit(ALPHA, Period.DAY), 6_000, "acme", "alpha")
    kept = await ledger.set_policy(raised, now=SEP30_LATE, keep_alerts=True)
    assert kept.alert_at == (50, 90) and kept.amount == 6_000
    assert await ledger.list_policies("acme") == [kept]
    silenced = Policy(Limit(ALPHA, Period.DAY), 6_000, "acme", "alpha", alert_at=())
    await ledger.set_policy(silenced, now=SEP30_LATE)
    assert [p.alert_at for p in await ledger.list_policies("acme")] == [()]
    await ledger.set_policy(raised, now=SEP30_LATE)  # not kept: back to the default
    assert [p.alert_at for p in await ledger.list_policies("acme")] == [None]
    new = Policy(Limit(ALPHA, Period.MONTH), 9, "acme", "alpha", alert_at=(80,))
    assert (await ledger.set_policy(new, now=SEP30_LATE, keep_alerts=True)).alert_at is None


async def test_a_database_from_before_alert_thresholds_gets_the_column(database_url: str) -> None:
    old = Ledger(database_url)
    await old.connect()
    await old.init_schema()
    await old.set_policy(policy(Period.DAY, 5_000), now=SEP30_LATE)
    await old.disconnect()
    await sql_execute(database_url, "ALTER TABLE spendguard_policies DROP COLUMN alert_at")
    led = Ledger(database_url)
    await led.connect()
    try:
        await led.init_schema()
        assert await led.list_policies("acme") == [policy(Period.DAY, 5_000)]  # the default
        own = Policy(Limit(ALPHA, Period.MONTH), 9, "acme", "alpha", alert_at=(75,))
        await led.set_policy(own, now=SEP30_LATE)
        assert [p.alert_at for p in await led.list_policies("acme")] == [None, (75,)]
    finally:
        await led.disconnect()


async def test_rates_set_list_remove_and_seen_as_a_policy_change(
    ledger: Ledger, database_url: str
) -> None:
    at = datetime(2026, 9, 30, 12, tzinfo=UTC)
    key = {"team_id": "acme", "api_key_id": "alpha", "now": at}
    team = {"team_id": "acme", "api_key_id": None, "now": at}
    await ledger.set_rates("acme", "alpha", value=Rates(rpm=60, max_parallel=2), **key)  # type: ignore[arg-type]
    await ledger.set_rates("acme", None, value=Rates(tpm=9), **team)  # type: ignore[arg-type]
    assert await ledger.load_rates("acme") == {"alpha": Rates(60, None, 2), None: Rates(tpm=9)}
    assert await ledger.list_rates("acme") == {
        "alpha": ("alpha", Rates(60, None, 2)),
        None: (None, Rates(tpm=9)),
    }
    assert "acme" in await ledger.policies_changed_since(int(at.timestamp() * 1_000_000))
    await ledger.set_rates("acme", None, value=Rates(), **team)  # type: ignore[arg-type]
    assert await ledger.load_rates("acme") == {"alpha": Rates(60, None, 2)}  # removed: inactive
    # A row written by hand is read within the bounds, never refused.
    bad = sa.update(rates_table).values(rpm=0, tpm=10**15).where(rates_table.c.api_key == "alpha")
    await sql_execute(database_url, bad)
    assert await ledger.load_rates("acme") == {"alpha": Rates(None, MAX_RATE, 2)}
