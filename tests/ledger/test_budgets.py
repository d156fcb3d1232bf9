"""The budgets' ledger queries on SQLite and PostgreSQL: per-key budgets and the usage a lost
bucket is rebuilt from, summed per slice."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from databases import Database
from sqlalchemy.dialects import postgresql, sqlite

from spendguard.identity import encode_id
from spendguard.ledger import BudgetOverride, Ledger
from spendguard.ledger.budgets import used_slices_query
from spendguard.record import InferenceRecord
from tests.support import make_record

pytestmark = pytest.mark.anyio

T = datetime(2026, 9, 30, 12, 0, tzinfo=UTC)


async def test_key_budgets_roundtrip(ledger: Ledger) -> None:
    override = BudgetOverride("acme", "alpha", "acme", "alpha", 5000, "24h")
    await ledger.set_budget_override(override)
    assert await ledger.budget_override("acme", "alpha") == override
    changed = BudgetOverride("acme", "alpha", "acme", "alpha", 10, "7d")
    await ledger.set_budget_override(changed)
    assert await ledger.budget_overrides() == [changed]
    assert await ledger.remove_budget_override("acme", "alpha")
    assert not await ledger.remove_budget_override("acme", "alpha")
    assert await ledger.budget_override("acme", "alpha") is None


async def test_used_slices_sum_per_slice_and_model(ledger: Ledger) -> None:
    records = [
        make_record("a", T, 10),
        make_record("b", T + timedelta(seconds=30), 5),  # same one-minute slice
        make_record("c", T + timedelta(minutes=1), 7),
        make_record("d", T - timedelta(hours=2), 100),  # before "since"
        make_record("e", T, 1000, key="beta"),
    ]
    await ledger.insert_records(records)
    since = T - timedelta(hours=1)
    rows = await ledger.used_slices(since=since, slice_us=60_000_000, team="acme", api_key="alpha")
    got = sorted((r.start_us, r.usage.input_tokens) for r in rows)
    start = int(T.timestamp()) * 1_000_000
    assert got == [(start, 15), (start + 60_000_000, 7)]
    everyone = await ledger.used_slices(since=since, slice_us=3_600_000_000)
    assert sum(r.usage.input_tokens for r in everyone) == 1022


async def test_used_slices_of_one_end_user_and_of_one_tag(ledger: Ledger) -> None:
    """What a lost end-user or tag bucket is rebuilt from: the records that carry it (a tag
    with a comma or a percent sign is found by its encoding, never by a part of another's)."""

    def tagged(rid: str, tokens: int, end_user: str | None, *tags: str) -> InferenceRecord:
        return dataclasses.replace(make_record(rid, T, tokens), end_user=end_user, tags=tags)

    await ledger.insert_records(
        [
            tagged("a", 10, "u1", "search", "50%,off"),
            tagged("b", 20, "u1", "50%"),
            tagged("c", 40, "u2", "search"),
            tagged("d", 80, None),
        ]
    )
    since = T - timedelta(hours=1)

    async def used(**filters: str) -> int:
        rows = await ledger.used_slices(since=since, slice_us=3_600_000_000, **filters)
        return sum(r.usage.input_tokens for r in rows)

    assert await used(team="acme", end_user=encode_id("u1")) == 30
    assert await used(team="acme", end_user=encode_id("u2")) == 40
    assert await used(tag=encode_id("search")) == 50
    assert await used(tag=encode_id("50%")) == 20
    assert await used(tag=encode_id("50%,off")) == 10


@pytest.mark.parametrize(
    "subject",
    [
        {"team": "acme", "api_key": "alpha"},
        {"team": "acme", "end_user": "u1"},
        {"customer": "globex"},
        {"model": "gpt-4o"},
        {"tag": "search"},
        {},
    ],
    ids=["key", "end_user", "customer", "model", "tag", "fleet"],
)
async def test_a_buckets_rebuild_reads_one_indexed_range_of_the_records(
    database_url: str, subject: dict[str, str]
) -> None:
    """A never-seen end user's first request rebuilds its bucket from the records: on a
    ledger with years of history that must be an index range over the subject's window, not a
    walk of every record (the plan, as each database's planner states it)."""
    ledger = Ledger(database_url)
    await ledger.connect()
    try:
        await ledger.init_schema()
        postgres = ledger.is_postgres
    finally:
        await ledger.disconnect()
    query = used_slices_query(since=T, slice_us=60_000_000, postgres=postgres, **subject)
    dialect = postgresql.dialect() if postgres else sqlite.dialect()
    sql = str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    db = Database(database_url)
    await db.connect()
    try:
        async with db.connection() as conn:
            if postgres:  # an empty table: let the plan show what a large one would use
                await conn.execute("SET enable_seqscan = off")
                plan = [str(r[0]) for r in await conn.fetch_all(f"EXPLAIN {sql}")]
            else:
                plan = [str(r[3]) for r in await conn.fetch_all(f"EXPLAIN QUERY PLAN {sql}")]
    finally:
        await db.disconnect()
    text = "\n".join(plan)
    assert "spendguard_records_" in text and "_t0" in text, text
    assert "Seq Scan" not in text and "SCAN spendguard_records\n" not in text + "\n", text
