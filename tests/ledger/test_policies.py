"""The SQL ledger against real SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.identity import Identity
from spendguard.ledger import Account, Aggregate, Ledger, RecordRow, SettledRecord, SpendRow
from spendguard.limits import Balance, Limit, Period, Policy, Subject, limit_for
from spendguard.record import InferenceRecord, PostflightStatus
from spendguard.usage import Usage
from tests.support import topups_total

pytestmark = pytest.mark.anyio

SEP30_LATE = datetime(2026, 9, 30, 23, 59, 59, 999000, tzinfo=UTC)
OCT1 = datetime(2026, 10, 1, 0, 0, 5, tzinfo=UTC)

ACME = Subject("acme")
ALPHA = Subject("acme", "alpha")


def record(
    rid: str,
    t0: datetime,
    tokens: int,
    team: str = "acme",
    key: str | None = "alpha",
    postflight: PostflightStatus = PostflightStatus.APPLIED,
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
        postflight=postflight,
    )


def price(rec: RecordRow) -> int:
    return rec.input_tokens  # one micro-USD per token keeps expectations obvious


def policy(period: Period, amount: int, key: str | None = "alpha", team: str = "acme") -> Policy:
    ident = Identity(team, key)
    return Policy(limit_for(ident, period), amount, team_id=team, api_key_id=key)


async def set_policy(
    led: Ledger, period: Period, amount: int, key: str | None = "alpha", now: datetime = SEP30_LATE
) -> Policy:
    return await led.set_policy(policy(period, amount, key), now=now)


async def test_schema_init_is_idempotent(ledger: Ledger) -> None:
    await ledger.init_schema()
    await ledger.init_schema()
    assert await ledger.list_policies() == []


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


async def test_records_are_written_once(ledger: Ledger) -> None:
    rec = record("r1", SEP30_LATE, 10)
    await ledger.insert_records([rec])
    await ledger.insert_records([rec])  # a re-send after an unknown outcome
    assert await ledger.unsettled() == (1, 10)
    assert await ledger.unsettled("acme") == (1, 10)
    assert await ledger.unsettled("other") == (0, 0)


async def test_settlement_lands_in_t0_periods_and_only_policy_scopes(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000)
    await set_policy(ledger, Period.MONTH, 1_000, key=None)
    await ledger.insert_records([record("late", SEP30_LATE, 7), record("next", OCT1, 11)])
    done = await ledger.settle(100, price, now=OCT1)
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
    assert (await ledger.settle(100, price, now=OCT1)).charged == 0  # nothing twice
    assert await ledger.charges_total("acme") == 18
    assert await ledger.charges_total() == 18


async def test_one_update_per_aggregate_row_sums_a_batch(ledger: Ledger) -> None:
    await set_policy(ledger, Period.MONTH, 10**12, key=None, now=OCT1)
    await ledger.insert_records([record(f"r{i}", OCT1, i) for i in range(1, 301)])
    done = await ledger.settle(1000, price, now=OCT1)
    assert done.charged == 300
    assert await ledger.aggregates("acme") == [
        Aggregate(Limit(ACME, Period.MONTH), "202610", sum(range(1, 301)))
    ]


async def test_new_policy_folds_in_the_periods_existing_charges(ledger: Ledger) -> None:
    await ledger.insert_records([record("a", OCT1, 40), record("b", OCT1, 2)])
    await ledger.settle(100, price, now=OCT1)  # no policy yet: charges, no aggregates
    assert await ledger.aggregates("acme") == []
    await set_policy(ledger, Period.DAY, 1_000, now=OCT1)
    wanted = (Limit(ALPHA, Period.DAY), "20261001")
    assert await ledger.load_aggregates("acme", [wanted]) == {wanted: 42}
    await set_policy(ledger, Period.DAY, 2_000, now=OCT1)  # amount change keeps the aggregate
    await ledger.insert_records([record("c", OCT1, 8)])
    await ledger.settle(100, price, now=OCT1)
    assert await ledger.load_aggregates("acme", [wanted]) == {wanted: 50}


async def test_removed_policy_stops_counting(ledger: Ledger) -> None:
    await set_policy(ledger, Period.DAY, 1_000, now=OCT1)
    await ledger.insert_records([record("a", OCT1, 5)])
    await ledger.settle(100, price, now=OCT1)
    await ledger.remove_policy(Limit(ALPHA, Period.DAY))
    await ledger.insert_records([record("b", OCT1, 6)])
    await ledger.settle(100, price, now=OCT1)
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
    await ledger.insert_records([record("late", SEP30_LATE, 7), record("next", OCT1, 11)])
    await ledger.settle(100, price, now=OCT1)
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
        [record("late", SEP30_LATE, 7), record("next", OCT1, 11), record("o", OCT1, 3, "other")]
    )
    await ledger.settle(100, price, now=OCT1)
    await ledger.remove_policy(Limit(ALPHA, Period.MONTH))
    await ledger.insert_records([record("nokey", OCT1, 2, team="nopolicy", key=None)])
    await ledger.settle(100, price, now=OCT1)

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


async def test_settled_records_say_what_they_count_toward(ledger: Ledger) -> None:
    await ledger.insert_records(
        [
            record("late", SEP30_LATE, 7),
            record("lost", OCT1, 11, key="beta", postflight=PostflightStatus.UNKNOWN),
            record("bare", OCT1, 1, key=None),
        ]
    )
    done = await ledger.settle(100, price, now=OCT1)
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


async def test_spend_reports_keys_and_team_per_window(ledger: Ledger) -> None:
    assert await ledger.spend("acme", OCT1) == [
        SpendRow(Limit(ACME, Period.DAY), None, "20261001", 0),
        SpendRow(Limit(ACME, Period.MONTH), None, "202610", 0),
    ]
    await ledger.insert_records(
        [
            record("late", SEP30_LATE, 7),  # September only
            record("a", OCT1, 11),
            record("b", OCT1, 5, key="b\u00e9ta"),  # raw id differs from the encoded one
            record("c", OCT1, 2, key=None),
            record("x", OCT1, 100, team="other"),
        ]
    )
    await ledger.settle(100, price, now=OCT1)
    beta = Identity("acme", "b\u00e9ta").api_key
    assert beta is not None and beta != "b\u00e9ta"
    rows = await ledger.spend("acme", datetime(2026, 10, 20, tzinfo=UTC))
    assert rows == [
        SpendRow(Limit(ACME, Period.DAY), None, "20261020", 0),
        SpendRow(Limit(ALPHA, Period.MONTH), "alpha", "202610", 11),
        SpendRow(Limit(Subject("acme", beta), Period.MONTH), "b\u00e9ta", "202610", 5),
        SpendRow(Limit(ACME, Period.MONTH), None, "202610", 18),
    ]
    sep = await ledger.spend("acme", SEP30_LATE)
    assert sep == [
        SpendRow(Limit(ALPHA, Period.DAY), "alpha", "20260930", 7),
        SpendRow(Limit(ACME, Period.DAY), None, "20260930", 7),
        SpendRow(Limit(ALPHA, Period.MONTH), "alpha", "202609", 7),
        SpendRow(Limit(ACME, Period.MONTH), None, "202609", 7),
    ]


async def test_unreachable_database_raises_ledger_unavailable() -> None:
    from spendguard.errors import LedgerUnavailable

    led = Ledger("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(LedgerUnavailable):
        await led.connect()


async def test_settlement_debits_balances_in_the_same_transaction(ledger: Ledger) -> None:
    assert await ledger.load_balance("acme") is None
    opened = await ledger.topup(team="acme", team_id="acme", micros=1_000)
    assert opened == Account("acme", 1_000, 0) and opened.balance == 1_000
    assert await ledger.load_limits("acme") == ([], opened)  # an account, no policy
    await ledger.insert_records(
        [record("a", OCT1, 7), record("b", OCT1, 8), record("c", OCT1, 9, team="other")]
    )
    await ledger.settle(100, price, now=OCT1)
    assert await ledger.load_balance("acme") == Account("acme", 1_000, 15)
    assert await ledger.load_balance("other") is None  # no account: not debited, not created
    account = await ledger.topup(team="acme", team_id="acme", micros=500)
    assert account == Account("acme", 1_500, 15) and account.balance == 1_485
    assert await ledger.balance_accounts() == {"acme": account}
    assert await topups_total(ledger.url, "acme") == 1_500
    with pytest.raises(ValueError):
        await ledger.topup(team="acme", team_id="acme", micros=0)


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
