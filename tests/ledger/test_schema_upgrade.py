"""A database an earlier release created is brought up to date at start: indexes that a later
release replaced are dropped and their replacements built, and nothing the database held is
lost or read differently."""

from __future__ import annotations

from datetime import timedelta

import pytest

from spendguard.ledger import Aggregate, Ledger
from spendguard.ledger.schema import RETIRED_INDEXES
from spendguard.limits import Limit, Period
from tests.ledger.helpers import ACME, ALPHA, OCT1, SEP30_LATE, set_policy
from tests.support import make_record, sql_execute, sql_rows, unit_price

pytestmark = pytest.mark.anyio

# The indexes as the release before them created them (SQLite and PostgreSQL alike).
EARLIER = {
    "spendguard_records_unsettled": "spendguard_records (settled, created_us)",
    "spendguard_charges_team_month": "spendguard_charges (team, month_id, api_key)",
    "spendguard_charges_team_day": "spendguard_charges (team, day_id, api_key)",
}
CURRENT = ("spendguard_records_to_settle", "spendguard_charges_team_bucket")


async def _indexes(url: str) -> set[str]:
    if url.startswith("sqlite"):
        query = "SELECT name FROM sqlite_master WHERE type = 'index'"
    else:
        query = "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
    return {str(row[0]) for row in await sql_rows(url, query)}


async def test_an_earlier_release_indexes_are_replaced_and_nothing_is_read_differently(
    database_url: str,
) -> None:
    old = Ledger(database_url)
    await old.connect()
    await old.init_schema()
    await set_policy(old, Period.DAY, 1_000)
    await set_policy(old, Period.MONTH, 1_000, key=None)
    # Settled under the earlier schema: one charge on Sep 30, one on Oct 1.
    await old.insert_records([make_record("late", SEP30_LATE, 7), make_record("next", OCT1, 11)])
    assert (await old.settle(100, unit_price, now=OCT1)).charged == 2
    await old.disconnect()
    for name in CURRENT:
        await sql_execute(database_url, f"DROP INDEX {name}")
    for name, on in EARLIER.items():
        await sql_execute(database_url, f"CREATE INDEX {name} ON {on}")
    assert set(EARLIER) == set(RETIRED_INDEXES)
    assert set(EARLIER) <= await _indexes(database_url)

    led = Ledger(database_url)
    await led.connect()
    try:
        await led.init_schema()
        await led.init_schema()  # idempotent
        found = await _indexes(database_url)
        assert set(CURRENT) <= found
        assert not set(EARLIER) & found
        # Unsettled records written before the upgrade are found and settled after it.
        await led.insert_records([make_record("after", OCT1 + timedelta(hours=1), 5)])
        assert await led.unsettled() == (1, 5)
        assert (await led.settle(100, unit_price, now=OCT1)).charged == 1
        assert await led.unsettled() == (0, 0)
        # A day's and a month's spend, read through the one charges index.
        rows = {(r.limit.window, r.bucket, r.api_key_id): r.spent for r in await led.spend(
            "acme", OCT1 + timedelta(hours=2)
        )}  # fmt: skip
        assert rows[(Period.DAY, "20261001", "alpha")] == 16
        assert rows[(Period.MONTH, "202610", None)] == 16
        day_before = {
            (r.limit.window, r.bucket): r.spent for r in await led.spend("acme", SEP30_LATE)
        }
        assert day_before[(Period.DAY, "20260930")] == 7
        # New policies build their aggregates from the charges of their bucket only.
        later = OCT1 + timedelta(hours=2)
        await set_policy(led, Period.MONTH, 2_000, key="alpha", now=later)
        await set_policy(led, Period.DAY, 2_000, key=None, now=later)
        built = set(await led.aggregates("acme"))
        assert Aggregate(Limit(ALPHA, Period.MONTH), "202610", 16) in built
        assert Aggregate(Limit(ACME, Period.DAY), "20261001", 16) in built
        assert await led.charges_total("acme") == 23
    finally:
        await led.disconnect()
