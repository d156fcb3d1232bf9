"""A database an earlier release created is brought up to date at start: indexes that a later
release replaced are dropped and their replacements built, and nothing the database held is
lost or read differently."""

from __future__ import annotations

from datetime import timedelta

import anyio
import pytest

from spendguard.clock import to_micros
from spendguard.engine.costing import Coster
from spendguard.engine.pricing import Price, PriceTable
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger import Aggregate, Ledger
from spendguard.ledger.schema import RETIRED_INDEXES, records
from spendguard.limits import KeyCodec, Limit, Period
from spendguard.settings import UnknownModel
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


# The records table as releases before records carried their price created it.
RECORDS_BEFORE_PRICES = """CREATE TABLE spendguard_records (
    id VARCHAR(64) NOT NULL PRIMARY KEY,
    inference_id VARCHAR(64) NOT NULL,
    team VARCHAR(100) NOT NULL,
    api_key VARCHAR(100) NOT NULL,
    team_id TEXT NOT NULL,
    api_key_id TEXT,
    model TEXT NOT NULL,
    route TEXT NOT NULL,
    t0_us BIGINT NOT NULL,
    status_code INTEGER NOT NULL,
    input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    cached_input_tokens BIGINT NOT NULL,
    cache_write_tokens BIGINT NOT NULL,
    usage_estimated BOOLEAN NOT NULL,
    estimate_micros BIGINT NOT NULL,
    postflight VARCHAR(16) NOT NULL,
    settled BOOLEAN NOT NULL,
    created_us BIGINT NOT NULL
)"""
OLD_ROW = (
    "INSERT INTO spendguard_records VALUES ('{id}', '{id}', 'acme', 'alpha', 'acme', 'alpha', "
    "'m', '/v1/chat/completions', {t0}, 200, {tokens}, 0, 0, 0, FALSE, {tokens}, 'applied', "
    "{settled}, {t0})"
)


async def _record_columns(url: str) -> list[str]:
    if url.startswith("sqlite"):
        return [str(r[1]) for r in await sql_rows(url, "PRAGMA table_info(spendguard_records)")]
    query = (
        "SELECT column_name FROM information_schema.columns WHERE table_schema = "
        "current_schema() AND table_name = 'spendguard_records' ORDER BY ordinal_position"
    )
    return [str(r[0]) for r in await sql_rows(url, query)]


async def test_a_records_table_from_before_prices_gets_the_column_and_keeps_its_rows(
    database_url: str,
) -> None:
    first = Ledger(database_url)
    await first.connect()
    await first.init_schema()  # every other table, as the earlier release left them
    await first.disconnect()
    await sql_execute(database_url, "DROP TABLE spendguard_records")
    await sql_execute(database_url, RECORDS_BEFORE_PRICES)
    t0 = to_micros(OCT1)
    for rid, tokens, settled in (("old-settled", 3, "TRUE"), ("old", 40, "FALSE")):
        await sql_execute(
            database_url, OLD_ROW.format(id=rid, t0=t0, tokens=tokens, settled=settled)
        )
    before = await sql_rows(database_url, "SELECT * FROM spendguard_records ORDER BY id")
    assert "price" not in await _record_columns(database_url)

    # Replicas starting together on the old database: each adds what is missing, once.
    ledgers = [Ledger(database_url) for _ in range(3)]
    for led in ledgers:
        await led.connect()
    try:
        async with anyio.create_task_group() as tg:
            for led in ledgers:
                tg.start_soon(led.init_schema)
        led = ledgers[0]
        await led.init_schema()  # and again at the next start: nothing to do
        assert await _record_columns(database_url) == [c.name for c in records.columns]
        after = await sql_rows(database_url, "SELECT * FROM spendguard_records ORDER BY id")
        # Kept as they were: no price, no end user, no tags, no customer.
        assert after == [(*row, *[None] * 7) for row in before]
        # The old unsettled record settles at the settling table; a new one at its own price.
        await led.insert_records([make_record("new", OCT1, 40)])
        table = PriceTable({"m": Price.of("2", "3")}, as_of="2026-11-01")
        worker = SettlementWorker(
            led, None, Coster(table, UnknownModel.FREE), KeyCodec("q", timedelta(days=2))
        )
        assert (await worker.run_once()).settled == 2
        got = await sql_rows(
            database_url, "SELECT record_id, amount_micros FROM spendguard_charges"
        )
        assert dict(got) == {"old": 80, "new": 40}
    finally:
        for led in ledgers:
            await led.disconnect()
