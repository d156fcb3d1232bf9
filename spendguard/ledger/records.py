"""Inference records: written once by the recorder, read back by the worker and the CLI.

A record is what one inference cost by its estimate; settlement (see
:mod:`spendguard.ledger.settlement`) prices it, charges it once and marks it settled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import anyio
import sqlalchemy as sa

from ..clock import from_micros, to_micros, utcnow
from ..identity import encode_id
from ..record import InferenceRecord, PostflightStatus
from .database import (
    ROWS_PER_STATEMENT,
    LedgerDatabase,
    SqliteBatchWriter,
    SqliteBusy,
    _text,
    _tuples,
)
from .journal import SettledRecord
from .schema import charges, records


def _pg_type(column: sa.Column[Any]) -> str:
    if isinstance(column.type, sa.Boolean):
        return "boolean"
    if isinstance(column.type, sa.BigInteger):
        return "bigint"
    if isinstance(column.type, sa.Integer):
        return "integer"
    return "text"


_COLUMNS = [c.name for c in records.columns]
_NAMES = ", ".join(_COLUMNS)


def _pg_value(index: int, column: sa.Column[Any]) -> str:
    kind = _pg_type(column)
    return f"r->>{index}" if kind == "text" else f"(r->>{index})::{kind}"


# Fixed statements, so nothing is compiled per batch (SQLAlchemy's multi-row INSERT compiled
# every batch anew, on the event loop: most of a record's write cost). PostgreSQL takes a whole
# chunk as one JSON array of rows, and asyncpg prepares the statement once per connection:
# asyncpg encodes an array parameter element by element, with two isinstance checks against
# abstract classes each (about 28 per record over one array per column), where one json.dumps
# is a single C call; that took 11 µs of the gateway's CPU per record. Every text in a row is
# an encoded id or went through `_text` (no NUL, no lone surrogate for jsonb to refuse), and
# integers go through jsonb's numeric exactly. SQLite runs one prepared statement over the rows.
_PG_INSERT = (
    f"INSERT INTO {records.name} ({_NAMES}) SELECT "
    + ", ".join(_pg_value(i, c) for i, c in enumerate(records.columns))
    + " FROM jsonb_array_elements($1::jsonb) AS r ON CONFLICT (id) DO NOTHING"
)
_SQLITE_INSERT = (
    f"INSERT INTO {records.name} ({_NAMES}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (id) DO NOTHING"
)
_SQLITE_BUSY_SECONDS = 5.0  # what `databases` connections wait for the lock, too


class RecordQueries(LedgerDatabase):
    async def insert_records(self, batch: Sequence[InferenceRecord]) -> None:
        """Write records idempotently: a record re-sent after an unknown outcome is kept once."""
        if not batch:
            return
        now_us = to_micros(utcnow())
        rows = [_record_row(r, now_us) for r in batch]
        writer = self._batch_writer
        if writer is not None:  # SQLite in a file: see SqliteBatchWriter
            async with self._guard("record write"):
                await self._write_when_free(writer, rows)
                if writer.checkpoint_due:
                    await anyio.to_thread.run_sync(writer.checkpoint)
            return
        if self.is_postgres:
            # Each chunk is one statement, its own transaction: no BEGIN/COMMIT round trips and
            # no `databases` transaction machinery (most of a small batch's cost). A batch cut
            # short by a failure is re-sent whole; ON CONFLICT keeps each record once.
            async with self._guard("record write"), self._db.connection() as conn:
                raw = conn.raw_connection
                for start in range(0, len(rows), ROWS_PER_STATEMENT):
                    chunk = rows[start : start + ROWS_PER_STATEMENT]
                    await raw.execute(_PG_INSERT, json.dumps(chunk, separators=(",", ":")))
            return
        async with self._guard("record write"), self._db.transaction():
            # In-memory SQLite: only `databases`' own connection sees the tables.
            raw = self._db.connection().raw_connection
            for start in range(0, len(rows), ROWS_PER_STATEMENT):
                await raw.executemany(_SQLITE_INSERT, rows[start : start + ROWS_PER_STATEMENT])

    @staticmethod
    async def _write_when_free(writer: SqliteBatchWriter, rows: list[tuple[Any, ...]]) -> None:
        """Write now, or as soon as the write lock is free (polled, never waited for on the
        event loop); after as long as SQLite's own busy timeout would wait, give up."""
        deadline = time.monotonic() + _SQLITE_BUSY_SECONDS
        while True:
            try:
                writer.execute_many(_SQLITE_INSERT, rows)
                return
            except SqliteBusy:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.002)

    async def unsettled(self, team: str | None = None) -> tuple[int, int]:
        """(count, sum of estimates in micro-USD) of the records not settled yet."""
        query = sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.sum(records.c.estimate_micros), 0)
        ).where(records.c.settled == sa.false())
        if team is not None:
            query = query.where(records.c.team == team)
        async with self._guard("record read"):
            row = await self._db.fetch_one(query)
        assert row is not None  # an aggregate query always returns one row
        return int(row[0]), int(row[1])

    async def recorded(self, record_ids: Sequence[str]) -> set[str]:
        """Which of these records are in the ledger, settled or not."""
        out: set[str] = set()
        ids = list(dict.fromkeys(record_ids))
        async with self._guard("record read"):
            for start in range(0, len(ids), ROWS_PER_STATEMENT):
                chunk = ids[start : start + ROWS_PER_STATEMENT]
                query = sa.select(records.c.id).where(records.c.id.in_(chunk))
                out.update(str(row[0]) for row in await self._db.fetch_all(query))
        return out

    async def settled_records(self, record_ids: Sequence[str]) -> dict[str, SettledRecord]:
        """Which of these records are settled (by any worker, at any time), and where they
        count. The worker asks this of estimates its cache still holds."""
        out: dict[str, SettledRecord] = {}
        ids = list(dict.fromkeys(record_ids))
        async with self._guard("charge read"):
            for start in range(0, len(ids), ROWS_PER_STATEMENT):
                query = (
                    sa.select(
                        charges.c.record_id,
                        charges.c.team,
                        charges.c.api_key,
                        records.c.t0_us,
                        records.c.postflight,
                    )
                    .select_from(charges.join(records, records.c.id == charges.c.record_id))
                    .where(charges.c.record_id.in_(ids[start : start + ROWS_PER_STATEMENT]))
                )
                for rid, team, key, t0_us, status in _tuples(await self._db.fetch_all(query)):
                    out[rid] = SettledRecord(
                        id=rid,
                        team=team,
                        api_key=key or None,
                        t0=from_micros(int(t0_us)),
                        unknown=status == PostflightStatus.UNKNOWN,
                    )
        return out


def _record_row(r: InferenceRecord, now_us: int) -> tuple[Any, ...]:
    """One record as a row in the table's column order (checked by the assertion below)."""
    identity = r.identity
    return (
        r.id,
        r.inference_id,
        identity.team,
        identity.api_key or "",
        _text(identity.team_id),
        _text(identity.api_key_id),
        _text(r.model),
        _text(r.route),
        to_micros(r.t0),
        r.status_code,
        r.usage.input_tokens,
        r.usage.output_tokens,
        r.usage.cached_input_tokens,
        r.usage.cache_write_tokens,
        r.usage.estimated,
        r.estimate_micros,
        r.postflight.value,
        False,  # settled
        now_us,  # created_us
        _text(r.price),
        *_parties(r),
    )


def _parties(r: InferenceRecord) -> tuple[str | None, ...]:
    """The end user, tags and customer columns of a record (all None without them)."""
    end_user, tags, customer = r.end_user, r.tags, r.customer
    return (
        None if end_user is None else encode_id(end_user),
        _text(end_user),
        tags_column(tags),
        json.dumps([_text(t) for t in tags], ensure_ascii=False) if tags else None,
        None if customer is None else encode_id(customer),
        _text(customer),
    )


def tags_column(tags: Sequence[str]) -> str | None:
    """The ``tags`` column of a record with ``tags``: their encodings between commas."""
    return "," + ",".join(encode_id(t) for t in tags) + "," if tags else None


# The row above and the table must agree column for column; a schema change that forgets the
# row fails at import, not on a customer's records.
if _COLUMNS != [
    "id",
    "inference_id",
    "team",
    "api_key",
    "team_id",
    "api_key_id",
    "model",
    "route",
    "t0_us",
    "status_code",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "usage_estimated",
    "estimate_micros",
    "postflight",
    "settled",
    "created_us",
    "price",
    "end_user",
    "end_user_id",
    "tags",
    "tag_ids",
    "customer",
    "customer_id",
]:
    raise RuntimeError(f"spendguard_records columns changed: {_COLUMNS}")
