"""Tests for spendguard.ledger.records: inference records are written once, whatever they hold."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from spendguard.clock import to_micros
from spendguard.errors import LedgerBusy
from spendguard.identity import Identity
from spendguard.ledger import Ledger
from spendguard.ledger import records as records_module
from spendguard.ledger.database import SqliteBatchWriter, SqliteBusy
from spendguard.ledger.schema import records
from spendguard.record import InferenceRecord, PostflightStatus
from spendguard.usage import Usage
from tests.ledger.helpers import SEP30_LATE
from tests.support import make_record, sql_rows

pytestmark = pytest.mark.anyio

TIERED = "0.15,0.6,0.075,0.15|200000:0.3,1.2,0.15,0.3"  # a price as Price.encode writes it


async def test_records_are_written_once(ledger: Ledger) -> None:
    rec = make_record("r1", SEP30_LATE, 10)
    await ledger.insert_records([rec])
    await ledger.insert_records([rec])  # a re-send after an unknown outcome
    assert await ledger.unsettled() == (1, 10)
    assert await ledger.unsettled("acme") == (1, 10)
    assert await ledger.unsettled("other") == (0, 0)


async def test_hostile_display_text_is_stored(ledger: Ledger) -> None:
    odd = InferenceRecord(
        id="odd",
        inference_id="odd",
        identity=Identity("team\x00nul", "key\ud800"),
        model="m\x00",
        route="/v1/chat/completions",
        t0=datetime(2026, 10, 1, tzinfo=UTC),
        status_code=200,
        usage=Usage(input_tokens=1),
        estimate_micros=1,
        postflight=PostflightStatus.APPLIED,
        price="1,1,1,1",
    )
    await ledger.insert_records([odd])
    assert await ledger.unsettled() == (1, 1)


async def test_display_text_that_needs_escaping_is_stored_exactly(ledger: Ledger) -> None:
    # PostgreSQL's writer sends a chunk as one JSON document: whatever JSON escapes (quotes,
    # backslashes, control characters, non-ASCII, characters beyond the BMP) must come back
    # as given, on both databases.
    texts = ['say "hi"\\', "tab\tline\nend", "Grüße 😀 \u2028 ok", "\x1f\x7f"]
    batch = [
        InferenceRecord(
            id=f"esc-{i}",
            inference_id=f"esc-{i}",
            identity=Identity(text, text),
            model=text,
            route=text,
            t0=datetime(2026, 10, 1, tzinfo=UTC),
            status_code=200,
            usage=Usage(input_tokens=1),
            estimate_micros=1,
            postflight=PostflightStatus.APPLIED,
            price="1,1,1,1",
        )
        for i, text in enumerate(texts)
    ]
    await ledger.insert_records(batch)
    columns = [records.c.team_id, records.c.api_key_id, records.c.model, records.c.route]
    rows = await sql_rows(ledger.url, sa.select(*columns).order_by(records.c.id))
    assert rows == [(text, text, text, text) for text in texts]


async def test_every_column_is_written_as_given(ledger: Ledger) -> None:
    # The writer sends fixed statements straight to the driver: each column must land as the
    # table defines it (booleans, big integers, NULL display ids), on both databases.
    t0 = datetime(2026, 9, 30, 23, 59, 59, 999999, tzinfo=UTC)
    big = 2**53 + 1
    with_key = InferenceRecord(
        id="r-key",
        inference_id="inf-1",
        identity=Identity("Team A", "key:1"),
        model="gpt-4o-mini",
        route="/v1/chat/completions",
        t0=t0,
        status_code=201,
        usage=Usage(
            input_tokens=big,
            output_tokens=2,
            cached_input_tokens=3,
            cache_write_tokens=4,
            estimated=True,
        ),
        estimate_micros=big,
        postflight=PostflightStatus.UNKNOWN,
        price=TIERED,
    )
    team_only = InferenceRecord(
        id="r-team",
        inference_id="r-team",
        identity=Identity("acme"),
        model="m",
        route="/v1/messages",
        t0=t0,
        status_code=200,
        usage=Usage(),
        estimate_micros=0,
        postflight=PostflightStatus.APPLIED,
        price=None,  # as a record of an earlier release's entry: NULL
    )
    await ledger.insert_records([with_key, team_only])
    columns = [
        records.c.id,
        records.c.inference_id,
        records.c.team,
        records.c.api_key,
        records.c.team_id,
        records.c.api_key_id,
        records.c.model,
        records.c.route,
        records.c.t0_us,
        records.c.status_code,
        records.c.input_tokens,
        records.c.output_tokens,
        records.c.cached_input_tokens,
        records.c.cache_write_tokens,
        records.c.usage_estimated,
        records.c.estimate_micros,
        records.c.postflight,
        records.c.settled,
        records.c.price,
    ]
    rows = await sql_rows(ledger.url, sa.select(*columns).order_by(records.c.id))
    t0_us = to_micros(t0)
    assert [(r[0], *r[1:14], bool(r[14]), *r[15:17], bool(r[17]), r[18]) for r in rows] == [
        ("r-key", "inf-1", "Team%20A", "key%3A1", "Team A", "key:1", "gpt-4o-mini",
         "/v1/chat/completions", t0_us, 201, big, 2, 3, 4, True, big, "unknown", False, TIERED),
        ("r-team", "r-team", "acme", "", "acme", None, "m",
         "/v1/messages", t0_us, 200, 0, 0, 0, 0, False, 0, "applied", False, None),
    ]  # fmt: skip


async def test_a_large_batch_is_written_in_chunks_once(ledger: Ledger) -> None:
    batch = [make_record(f"r{n}", SEP30_LATE, 1) for n in range(1_234)]
    await ledger.insert_records(batch)
    await ledger.insert_records(batch[600:700])  # re-sent: kept once
    assert await ledger.unsettled() == (1_234, 1_234)


async def test_on_sqlite_a_held_write_lock_is_waited_for_without_blocking_the_loop(
    sqlite_url: str,
) -> None:
    """The record writer writes on the event loop: while another connection (settlement, the
    CLI) holds the write lock it must poll, not sit in SQLite's busy wait, and then write."""
    ledger = Ledger(sqlite_url)
    await ledger.connect()
    await ledger.init_schema()
    await ledger.insert_records([make_record("warm", SEP30_LATE, 1)])  # writer connection open
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.001)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            with anyio.fail_after(5):
                async with anyio.create_task_group() as writes:
                    writes.start_soon(ledger.insert_records, [make_record("r1", SEP30_LATE, 7)])
                    await anyio.sleep(0.2)
                    assert ticks >= 50  # the loop ran on while the write waited
                    holder.execute("COMMIT")  # the lock is free: the write goes through
            tg.cancel_scope.cancel()
        assert await ledger.unsettled() == (2, 8)
    finally:
        holder.close()
        await ledger.disconnect()


async def test_on_sqlite_a_write_lock_held_too_long_is_busy_not_a_refused_record(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records_module, "_SQLITE_BUSY_SECONDS", 0.05)
    ledger = Ledger(sqlite_url)
    await ledger.connect()
    await ledger.init_schema()
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LedgerBusy):
            await ledger.insert_records([make_record("r1", SEP30_LATE, 7)])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    await ledger.insert_records([make_record("r1", SEP30_LATE, 7)])
    assert await ledger.unsettled() == (1, 7)
    await ledger.disconnect()


def test_on_sqlite_a_lock_met_while_the_writer_connects_is_busy_not_a_refused_record(
    tmp_path: Path,
) -> None:
    """The writer's first statements on a new connection (its PRAGMAs) can meet another
    connection's lock too: that is busy (the batch is retried), not a record the database
    refuses (which would be dropped)."""
    path = str(tmp_path / "locked.db")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (a INTEGER)")
    holder.execute("BEGIN EXCLUSIVE")
    writer = SqliteBatchWriter(path)
    try:
        with pytest.raises(SqliteBusy):
            writer.execute_many("INSERT INTO t VALUES (?)", [(1,)])
        holder.execute("COMMIT")
        writer.execute_many("INSERT INTO t VALUES (?)", [(2,)])  # a fresh connection works
        assert holder.execute("SELECT a FROM t").fetchall() == [(2,)]
    finally:
        writer.close()
        holder.close()
