"""The statements of one settlement batch, as fixed SQL text per backend.

Settlement sends these straight to the driver (the transaction's own connection, below
`databases`), so nothing is built or compiled per batch: compiling SQLAlchemy statements was
half of a settlement pass. PostgreSQL takes a whole batch as one array per column (``unnest``),
or the charges as one JSON array, and asyncpg prepares each statement once per connection;
SQLite runs one prepared statement over the rows (``executemany``), in process, so a statement
per row costs no round trip.

Both classes have the same methods; :mod:`.settlement` decides what a batch writes and calls
them in order, inside one transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from .schema import aggregates, balances, charges, policies, records, settlements

# What settlement reads of a claimed record, in this order (see ``RecordRow``).
CLAIMED_COLUMNS = (
    "id",
    "team",
    "api_key",
    "model",
    "t0_us",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "estimate_micros",
    "postflight",
    "price",
)
_CLAIMED = ", ".join(f"r.{c}" for c in CLAIMED_COLUMNS)
_CHARGE_COLUMNS = "record_id, team, api_key, model, day_id, month_id, amount_micros, settled_us"
_AGGREGATE_KEY = "team, api_key, period, period_id"
# SQLite's cap on the parameters of one statement was 999 before 3.32.
_SQLITE_MAX_PARAMS = 500

Row = Sequence[Any]


# One charge to write: record id, team, api_key ('' for a record without a key, as in the
# table), model, day id, month id, micro-USD.
Charge = tuple[str, str, str, str, str, str, int]


# One aggregate delta: team, api_key ('' for a team limit), period, bucket, micro-USD.
AggregateRow = tuple[str, str, str, str, int]
# A limit a batch took past its amount: api_key ('' for a team limit), period, and the part of
# the batch's delta beyond the amount (never more than the delta: counted once per batch).
OverLimit = tuple[str, str, int]


class PostgresSettlement:
    """PostgreSQL: one statement per step, each taking the whole batch."""

    # Claiming and marking settled is one statement: the claimed rows are locked (another
    # worker skips them) and flagged in the same pass over them. The transaction commits or
    # rolls back as a whole, so the flag never outlives a failed batch. The rows are found
    # again by their physical address (a TID scan), not joined back by primary key: no index
    # lookup per row, and a row this transaction has locked cannot move before it ends.
    CLAIM = (
        f"UPDATE {records.name} AS r SET settled = true WHERE r.ctid = ANY(ARRAY("
        f"SELECT ctid FROM {records.name} WHERE NOT settled "
        f"ORDER BY created_us, id LIMIT $1 FOR UPDATE SKIP LOCKED)) "
        f"RETURNING {_CLAIMED}"
    )
    # The batch's charges arrive as one JSON array of rows, as the record writer sends records
    # (ledger/records.py says why: asyncpg's array encoding costs more than one json.dumps).
    # Every text in it came out of the database or is a bucket id, so jsonb refuses none.
    # RETURNING names the charges this batch wrote: one already there (written by anyone, at
    # any time) is neither written again nor added to an aggregate or a balance again.
    INSERT_CHARGES = (
        f"INSERT INTO {charges.name} ({_CHARGE_COLUMNS}) "
        "SELECT c->>0, c->>1, c->>2, c->>3, c->>4, c->>5, (c->>6)::bigint, $2::bigint "
        "FROM jsonb_array_elements($1::jsonb) AS c ON CONFLICT (record_id) DO NOTHING "
        "RETURNING record_id"
    )
    # Locks are taken in the order of the array (sorted by the caller): two settlements never
    # deadlock. The advisory-lock key of a team is the one `_lock_teams` uses.
    LOCK_TEAMS = (
        "SELECT pg_advisory_xact_lock(hashtextextended(u.team, 0)) "
        "FROM unnest($1::text[]) WITH ORDINALITY AS u(team, n) ORDER BY u.n"
    )
    BEARING = (
        f"SELECT team, api_key, period FROM {policies.name} WHERE team = ANY($1::text[]) AND active"
    )
    # One statement adds the deltas and answers which limits they took over their amount
    # (spendguard_overspend_micros_total): no round trip of its own.
    ADD_TO_AGGREGATES = (
        "WITH u AS (SELECT * FROM unnest("
        "$1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[]"
        ") AS u(team, api_key, period, period_id, delta)), "
        f"up AS (INSERT INTO {aggregates.name} ({_AGGREGATE_KEY}, settled_micros, updated_us) "
        "SELECT u.*, $6::bigint FROM u "
        f"ON CONFLICT ({_AGGREGATE_KEY}) DO UPDATE SET "
        f"settled_micros = {aggregates.name}.settled_micros + excluded.settled_micros, "
        f"updated_us = excluded.updated_us RETURNING {_AGGREGATE_KEY}, settled_micros) "
        "SELECT up.api_key, up.period, LEAST(u.delta, up.settled_micros - p.limit_micros) "
        f"FROM up JOIN u USING ({_AGGREGATE_KEY}) JOIN {policies.name} AS p "
        "ON p.team = up.team AND p.api_key = up.api_key AND p.period = up.period "
        "WHERE p.active AND up.settled_micros > p.limit_micros"
    )
    # Teams without an account match no row: not balance-limited. Each debited account answers
    # how far this debit took it below zero (positive: overdrawn by this batch).
    DEBIT = (
        f"UPDATE {balances.name} AS b SET charged_micros = b.charged_micros + u.amount, "
        "updated_us = $3 FROM unnest($1::text[], $2::bigint[]) AS u(team, amount) "
        "WHERE b.team = u.team "
        "RETURNING LEAST(u.amount, b.charged_micros - b.topped_up_micros)"
    )

    # The transaction's last statement, so the number it takes is close to its commit.
    JOURNAL = f"INSERT INTO {settlements.name} (settled_us, records) VALUES ($1, $2) RETURNING seq"

    async def claim(self, conn: Any, limit: int) -> tuple[list[Row], set[str]]:
        """The oldest unsettled records (up to ``limit``), locked and flagged settled."""
        return await conn.fetch(self.CLAIM, limit), set()

    async def lock_for_write(self, conn: Any) -> None:
        """PostgreSQL locks rows as it writes them; nothing to take up front."""

    async def insert_charges(self, conn: Any, batch: list[Charge], now_us: int) -> set[str]:
        """Write the charges; returns the record ids whose charge already existed."""
        if not batch:
            return set()
        rows = json.dumps(batch, separators=(",", ":"))
        written = await conn.fetch(self.INSERT_CHARGES, rows, now_us)
        if len(written) == len(batch):
            return set()
        return {c[0] for c in batch} - {row[0] for row in written}

    async def lock_teams(self, conn: Any, teams: list[str]) -> None:
        await conn.execute(self.LOCK_TEAMS, teams)

    async def bearing(self, conn: Any, teams: list[str]) -> list[Row]:
        return list(await conn.fetch(self.BEARING, teams))

    async def add_to_aggregates(
        self, conn: Any, rows: list[AggregateRow], now_us: int
    ) -> list[OverLimit]:
        """Add the deltas; returns the limits they took over their amount."""
        if not rows:
            return []
        columns = map(list, zip(*rows, strict=True))
        over = await conn.fetch(self.ADD_TO_AGGREGATES, *columns, now_us)
        return [(row[0], row[1], int(row[2])) for row in over]

    async def debit(self, conn: Any, debits: dict[str, int], now_us: int) -> list[int]:
        """Debit the accounts; returns the micro-USD each debit took an account beyond zero."""
        if not debits:
            return []
        rows = await conn.fetch(self.DEBIT, list(debits), list(debits.values()), now_us)
        return [int(row[0]) for row in rows if row[0] > 0]

    async def journal(self, conn: Any, now_us: int, records: str) -> int:
        """Write the batch's journal row; returns its number."""
        return int(await conn.fetchval(self.JOURNAL, now_us, records))


class SqliteSettlement:
    """SQLite: one prepared statement per step, run over the rows in process."""

    # The first statement of the transaction must write: see ``LedgerDatabase._lock_for_write``.
    LOCK_FOR_WRITE = f"UPDATE {records.name} SET settled = settled WHERE 0 = 1"
    # The write lock is held from the first statement, so nothing can charge a claimed record
    # between this read and the insert: the flag says which already have a charge.
    CLAIM = (
        f"SELECT {_CLAIMED}, EXISTS (SELECT 1 FROM {charges.name} AS c "
        f"WHERE c.record_id = r.id) FROM {records.name} AS r WHERE r.settled = 0 "
        "ORDER BY r.created_us, r.id LIMIT ?"
    )
    MARK_SETTLED = f"UPDATE {records.name} SET settled = 1 WHERE id = ?"
    INSERT_CHARGE = (
        f"INSERT INTO {charges.name} ({_CHARGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (record_id) DO NOTHING"
    )
    ADD_TO_AGGREGATE = (
        f"INSERT INTO {aggregates.name} ({_AGGREGATE_KEY}, settled_micros, updated_us) "
        f"VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT ({_AGGREGATE_KEY}) DO UPDATE SET "
        f"settled_micros = settled_micros + excluded.settled_micros, "
        "updated_us = excluded.updated_us"
    )
    DEBIT = (
        f"UPDATE {balances.name} SET charged_micros = charged_micros + ?, updated_us = ? "
        "WHERE team = ?"
    )
    JOURNAL = f"INSERT INTO {settlements.name} (settled_us, records) VALUES (?, ?)"

    async def lock_for_write(self, conn: Any) -> None:
        await conn.execute(self.LOCK_FOR_WRITE)

    async def claim(self, conn: Any, limit: int) -> tuple[list[Row], set[str]]:
        """The oldest unsettled records (up to ``limit``), flagged settled, and which of them
        already have a charge."""
        async with conn.execute(self.CLAIM, (limit,)) as cursor:
            rows = list(await cursor.fetchall())
        if rows:
            await conn.executemany(self.MARK_SETTLED, [(row[0],) for row in rows])
        charged = {row[0] for row in rows if row[-1]}
        return rows, charged

    async def insert_charges(self, conn: Any, batch: list[Charge], now_us: int) -> set[str]:
        """Write the charges (the claim already left out those that exist)."""
        if batch:
            await conn.executemany(self.INSERT_CHARGE, [(*c, now_us) for c in batch])
        return set()

    async def lock_teams(self, conn: Any, teams: list[str]) -> None:
        """The write lock taken first already serialises every writer."""

    async def bearing(self, conn: Any, teams: list[str]) -> list[Row]:
        out: list[Row] = []
        for start in range(0, len(teams), _SQLITE_MAX_PARAMS):
            chunk = teams[start : start + _SQLITE_MAX_PARAMS]
            async with conn.execute(_sqlite_bearing(len(chunk)), chunk) as cursor:
                out += await cursor.fetchall()
        return out

    async def add_to_aggregates(
        self, conn: Any, rows: list[AggregateRow], now_us: int
    ) -> list[OverLimit]:
        """Add the deltas; returns the limits they took over their amount (one read per up to
        125 rows, in process)."""
        if not rows:
            return []
        await conn.executemany(self.ADD_TO_AGGREGATE, [(*row, now_us) for row in rows])
        deltas = {row[:4]: row[4] for row in rows}
        over: list[OverLimit] = []
        step = _SQLITE_MAX_PARAMS // 4
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            params = [value for row in chunk for value in row[:4]]
            async with conn.execute(_sqlite_over_limit(len(chunk)), params) as cursor:
                for team, api_key, period, period_id, excess in await cursor.fetchall():
                    delta = deltas[(team, api_key, period, period_id)]
                    over.append((api_key, period, min(delta, int(excess))))
        return over

    async def debit(self, conn: Any, debits: dict[str, int], now_us: int) -> list[int]:
        """Debit the accounts; returns the micro-USD each debit took an account beyond zero
        (one read per up to 500 teams, in process)."""
        if not debits:
            return []
        await conn.executemany(self.DEBIT, [(a, now_us, t) for t, a in debits.items()])
        teams = list(debits)
        over: list[int] = []
        for start in range(0, len(teams), _SQLITE_MAX_PARAMS):
            chunk = teams[start : start + _SQLITE_MAX_PARAMS]
            async with conn.execute(_sqlite_overdrawn(len(chunk)), chunk) as cursor:
                for team, below in await cursor.fetchall():
                    over.append(min(debits[team], int(below)))
        return over

    async def journal(self, conn: Any, now_us: int, records: str) -> int:
        """Write the batch's journal row; returns its number."""
        async with conn.execute(self.JOURNAL, (now_us, records)) as cursor:
            return int(cursor.lastrowid)


@lru_cache(maxsize=64)
def _sqlite_bearing(teams: int) -> str:
    """The policy read for ``teams`` teams: one fixed text per count, prepared once each."""
    marks = ", ".join("?" * teams)
    return (
        f"SELECT team, api_key, period FROM {policies.name} WHERE active = 1 AND team IN ({marks})"
    )


@lru_cache(maxsize=64)
def _sqlite_overdrawn(teams: int) -> str:
    """Which of ``teams`` accounts are below zero, and by how much."""
    marks = ", ".join("?" * teams)
    return (
        f"SELECT team, charged_micros - topped_up_micros FROM {balances.name} "
        f"WHERE charged_micros > topped_up_micros AND team IN ({marks})"
    )


@lru_cache(maxsize=64)
def _sqlite_over_limit(rows: int) -> str:
    """Which of ``rows`` aggregate rows are over their active policy's amount, and by how
    much: one fixed text per count, prepared once each."""
    keys = ", ".join(["(?, ?, ?, ?)"] * rows)
    return (
        f"SELECT a.team, a.api_key, a.period, a.period_id, a.settled_micros - p.limit_micros "
        f"FROM {aggregates.name} AS a JOIN {policies.name} AS p ON p.team = a.team "
        "AND p.api_key = a.api_key AND p.period = a.period "
        "WHERE p.active = 1 AND a.settled_micros > p.limit_micros "
        f"AND (a.team, a.api_key, a.period, a.period_id) IN (VALUES {keys})"
    )


SettlementSql = PostgresSettlement | SqliteSettlement
