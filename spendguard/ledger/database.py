"""The connection to the ledger database and what every query needs around it.

It wraps ``databases`` (asyncio, SQLAlchemy Core) on SQLite or PostgreSQL: connecting, turning
any driver failure into :class:`LedgerUnavailable`, taking the write and per-team locks a
transaction needs, and creating the schema. The query modules build on :class:`LedgerDatabase`.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from databases import Database
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

from ..errors import LedgerBusy, LedgerDown, LedgerRefused, LedgerUnavailable
from .schema import RETIRED_INDEXES, metadata, records

ROWS_PER_STATEMENT = 500  # keeps a multi-row statement under SQLite's and asyncpg's parameter caps
_SCHEMA_LOCK = 0x5E9D6A4D  # an arbitrary, fixed advisory-lock id for schema creation


class LedgerDatabase:
    """One ledger database, by URL. Every method raises :class:`LedgerUnavailable` when the
    database fails, whatever the backend."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.is_postgres = url.startswith(("postgres", "postgresql"))
        self._db = Database(url)
        # Both dialects' INSERT has ON CONFLICT, which the generic one lacks.
        self._insert: Any = postgresql.insert if self.is_postgres else sqlite.insert
        path = self.sqlite_path
        self._batch_writer = SqliteBatchWriter(path) if path is not None else None

    async def connect(self) -> None:
        try:
            await self._db.connect()
        except Exception as exc:
            raise LedgerDown(f"cannot connect to the ledger database: {exc}") from exc

    async def disconnect(self) -> None:
        if self._batch_writer is not None:
            self._batch_writer.close()
        if self._db.is_connected:
            await self._db.disconnect()

    @property
    def sqlite_path(self) -> str | None:
        """The database file of a SQLite ledger (None for PostgreSQL or in-memory SQLite)."""
        if self.is_postgres:
            return None
        path = self.url.split("://", 1)[1].split("?", 1)[0]
        path = path[1:] if path.startswith("/") else path
        return None if path in ("", ":memory:") else path

    @property
    def connected(self) -> bool:
        return bool(self._db.is_connected)

    @asynccontextmanager
    async def _guard(self, what: str) -> AsyncIterator[None]:
        try:
            yield
        except LedgerUnavailable:
            raise
        except SqliteBusy as exc:
            raise LedgerBusy(f"ledger {what} waited too long for the write lock") from exc
        except Exception as exc:  # driver errors differ per backend; callers need one type
            self._forget_connection()
            kind = _classify(exc)
            raise kind(f"ledger {what} failed: {exc!r}") from exc

    @asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """Hold one connection for a block of queries (a settlement pass) instead of taking one
        per query: without a connection held by the task, `databases` opens a new SQLite
        connection (and its thread) for every query. Errors inside the block are the block's
        own; only failing to connect is turned into :class:`LedgerUnavailable` here."""
        connection = self._db.connection()
        try:
            await connection.__aenter__()
        except Exception as exc:
            self._forget_connection()
            raise LedgerDown(f"ledger connection failed: {exc!r}") from exc
        try:
            yield
        finally:
            try:
                await connection.__aexit__(None, None, None)
            except Exception:  # a connection that broke in the block: its query said so
                self._forget_connection()

    def _forget_connection(self) -> None:
        """Drop this task's `databases` connection after a failure.

        When the server goes away, `databases` (0.9) can fail while releasing a connection and
        keep it bound to the task, already handed back to the pool: every later query of that
        task then fails ("connection has been released back to the pool") even after the
        database is back. Forgetting it makes the next query acquire a fresh one.
        """
        with contextlib.suppress(Exception):
            self._db._connection = None

    async def _lock_for_write(self) -> None:
        """On SQLite, take the write lock as a transaction's first step.

        A transaction that reads first holds a WAL snapshot; if another connection (the record
        writer) commits before our first write, SQLite fails that write at once with "database
        is locked" instead of waiting. A no-op UPDATE as the first statement takes the write
        lock up front, waiting politely under the busy timeout. PostgreSQL needs none of this.
        """
        if not self.is_postgres:
            await self._db.execute(
                records.update().where(sa.false()).values(settled=records.c.settled)
            )

    async def _lock_teams(self, teams: Iterable[str]) -> None:
        """On PostgreSQL, serialise policy changes and settlements of the same team.

        Without it a settlement that read "no policy" and a policy activation that summed the
        charges committed so far can both miss the settlement's charges (READ COMMITTED).
        Locks are taken in sorted order, so two settlements never deadlock. SQLite already
        serialises writers (see ``_lock_for_write``).
        """
        if self.is_postgres:
            for team in sorted(set(teams)):
                await self._db.execute(
                    sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(team, 0)))
                )

    async def ping(self) -> None:
        async with self._guard("ping"):
            # Plain text: a bound literal would reach asyncpg as a text parameter it refuses
            # to take an int for, and a failing ping reads as "database down".
            await self._db.fetch_val("SELECT 1")

    async def init_schema(self) -> None:
        """Create the tables and indexes if they are missing (idempotent, safe at every start)."""
        dialect = self._db._backend._dialect
        if not self.is_postgres:
            async with self._guard("schema init"):
                # WAL lets the settlement worker and the record writer (or a CLI) work side by side.
                await self._db.execute("PRAGMA journal_mode=WAL")
                await self._create_tables(dialect)
            return
        # Replicas starting together on a fresh database would race in CREATE ... IF NOT
        # EXISTS (PostgreSQL reports a duplicate key): one transaction-scoped lock orders them.
        async with self._guard("schema init"), self._db.transaction():
            await self._db.execute(sa.select(sa.func.pg_advisory_xact_lock(_SCHEMA_LOCK)))
            await self._create_tables(dialect)

    async def _create_tables(self, dialect: Any) -> None:
        for table in metadata.sorted_tables:
            await self._db.execute(
                str(CreateTable(table, if_not_exists=True).compile(dialect=dialect))
            )
        # Indexes after the columns an older database lacks: some index them.
        await self._add_missing_columns()
        for table in metadata.sorted_tables:
            for index in table.indexes:
                await self._db.execute(
                    str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect))
                )
        for name in RETIRED_INDEXES:
            await self._db.execute(f"DROP INDEX IF EXISTS {name}")

    async def _add_missing_columns(self) -> None:
        """Columns added after a table was first created (a database from an earlier release):
        each is nullable or has a server default, so adding it to existing rows is safe, and
        it is added only where it is missing (idempotent; concurrent starts on PostgreSQL are
        ordered by the schema lock ``init_schema`` holds, and on SQLite the one that loses the
        race finds the column there)."""
        for table, name, ddl in _ADDED_COLUMNS:
            if self.is_postgres:
                rows = await self._db.fetch_all(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = :t",
                    {"t": table},
                )
                present = {str(r[0]) for r in rows}
            else:
                rows = await self._db.fetch_all(f"PRAGMA table_info({table})")
                present = {str(r[1]) for r in rows}
            if name not in present:
                try:
                    await self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}")
                except sqlite3.OperationalError as exc:
                    # Another process starting on the same SQLite file added it between the
                    # read and here (SQLite's schema steps are not under one lock as
                    # PostgreSQL's are): it is there, which is all this wants.
                    if "duplicate column" not in str(exc):
                        raise


def _classify(exc: BaseException) -> type[LedgerUnavailable]:
    """Which failure a driver's exception is: the data refused, no connection, or unknown.

    The record writer drops a record only when the database refused it; an exhausted
    connection limit or a broken socket must keep every record for a retry."""
    refused: tuple[type[BaseException], ...] = (
        OverflowError,
        UnicodeError,
        sqlite3.IntegrityError,
        sqlite3.DataError,
    )
    down: tuple[type[BaseException], ...] = (OSError, TimeoutError, ConnectionError)
    try:
        import asyncpg  # type: ignore[import-untyped]  # an optional driver, untyped

        # The server's DataError (SQLSTATE class 22) and the client's, raised while encoding
        # an argument (an InterfaceError and a ValueError).
        refused += (
            asyncpg.DataError,
            asyncpg.exceptions._base.DataError,
            asyncpg.IntegrityConstraintViolationError,
        )
        down += (
            asyncpg.PostgresConnectionError,
            asyncpg.InterfaceError,
            asyncpg.TooManyConnectionsError,
            asyncpg.CannotConnectNowError,
            asyncpg.InsufficientResourcesError,
        )
    except ImportError:  # pragma: no cover - SQLite-only installs
        pass
    if isinstance(exc, refused):  # first: a client-side DataError is an InterfaceError too
        return LedgerRefused
    if isinstance(exc, down):
        return LedgerDown
    return LedgerUnavailable


# (table, column, its DDL) added after the first release, in the order they were added.
_ADDED_COLUMNS = (
    ("spendguard_policies", "hard", "BOOLEAN NOT NULL DEFAULT FALSE"),
    ("spendguard_balances", "hard", "BOOLEAN NOT NULL DEFAULT FALSE"),
    ("spendguard_records", "price", "TEXT"),  # NULL: priced by the settling table
    ("spendguard_policies", "alert_at", "TEXT"),  # NULL: the gateway's default thresholds
    ("spendguard_records", "end_user", "VARCHAR(100)"),  # NULL: none (or an older record)
    ("spendguard_records", "end_user_id", "TEXT"),
    ("spendguard_records", "tags", "TEXT"),
    ("spendguard_records", "tag_ids", "TEXT"),
    ("spendguard_records", "customer", "VARCHAR(100)"),
    ("spendguard_records", "customer_id", "TEXT"),
    ("spendguard_policies", "fit", "BOOLEAN NOT NULL DEFAULT FALSE"),
)


class SqliteBusy(Exception):
    """Another connection holds the SQLite write lock (settlement, the CLI): try again soon."""


class SqliteBatchWriter:
    """One long-lived SQLite connection for batches of rows, written on the event loop.

    The `databases` SQLite backend opens a new connection (and a new thread) for every
    transaction: about 1.5 ms of CPU per batch. A worker thread of our own did not pay either:
    with the event loop busy, the GIL changes hands on every row, which cost the gateway about
    200 µs of CPU per record at one request at a time. So the batch runs right here, on a
    connection kept open: BEGIN IMMEDIATE, one fixed statement over the rows, COMMIT, tens of
    microseconds per batch. The commit does not fsync (WAL with ``synchronous=NORMAL``: safe
    against a crash of the process, not of the machine); a checkpoint in a worker thread syncs
    the WAL at least every second, which bounds what a power loss can take.

    Nothing here may wait on the loop: the busy timeout is 0, so a write lock held elsewhere
    raises :class:`SqliteBusy` at once and the caller sleeps (asynchronously) and retries; and
    this connection never checkpoints the WAL itself (``wal_autocheckpoint=0``):
    :meth:`checkpoint` does, on a connection of its own, meant for a worker thread.
    """

    # A checkpoint (which syncs the WAL to disk first) at least this often while rows arrive.
    CHECKPOINT_ROWS = 5_000
    CHECKPOINT_SECONDS = 1.0

    def __init__(self, path: str) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = None
        self._since_checkpoint = 0
        self._checkpointed_at = time.monotonic()

    def execute_many(self, statement: str, rows: Sequence[tuple[Any, ...]]) -> None:
        conn = self._conn
        if conn is None:
            conn = sqlite3.connect(self._path, timeout=0, isolation_level=None)
            try:
                conn.execute("PRAGMA wal_autocheckpoint=0")
                # No fsync at COMMIT, on the loop (about 1 ms under load: it showed in every
                # p99); the checkpoint in a worker thread syncs the WAL instead, at least every
                # second.
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.OperationalError as exc:
                # These meet the lock too (another connection's transaction): busy, not a
                # refused record, so the batch is retried instead of dropped.
                conn.close()
                if "locked" in str(exc) or "busy" in str(exc):
                    raise SqliteBusy(str(exc)) from exc
                raise
            self._conn = conn
        try:
            # IMMEDIATE takes the write lock first (as LedgerDatabase._lock_for_write explains).
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise SqliteBusy(str(exc)) from exc
            self._forget(conn)
            raise
        try:
            for start in range(0, len(rows), ROWS_PER_STATEMENT):
                conn.executemany(statement, rows[start : start + ROWS_PER_STATEMENT])
            conn.execute("COMMIT")
        except BaseException:
            # Whatever failed (a full disk, a vanished file, a refused row), the next batch
            # starts on a fresh connection, not inside a half-open transaction.
            self._forget(conn)
            raise
        self._since_checkpoint += len(rows)

    @property
    def checkpoint_due(self) -> bool:
        return self._since_checkpoint >= self.CHECKPOINT_ROWS or (
            self._since_checkpoint > 0
            and time.monotonic() - self._checkpointed_at >= self.CHECKPOINT_SECONDS
        )

    def checkpoint(self) -> None:
        """Sync the WAL to disk and copy it back into the database (PASSIVE: never waits for
        readers or writers). Blocking: run it in a worker thread."""
        self._since_checkpoint = 0
        self._checkpointed_at = time.monotonic()
        conn = sqlite3.connect(self._path, timeout=1.0)
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()

    def _forget(self, conn: sqlite3.Connection) -> None:
        self._conn = None
        conn.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _tuples(rows: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Rows as plain tuples: a `databases` Record iterates over its column names, not its
    values, so ``for a, b in rows`` would unpack names."""
    return [tuple(r._mapping.values()) for r in rows]


def _text(value: str | None) -> str | None:
    """Display text from the host app, made storable everywhere: PostgreSQL refuses NUL and
    lone surrogates in text, and one such record must not block the record writer."""
    if value is None:
        return None
    if value.isascii():  # the usual case, with no surrogate to replace
        return value if "\x00" not in value else value.replace("\x00", "\ufffd")
    cleaned = value.replace("\x00", "\ufffd")
    return cleaned.encode("utf-8", "replace").decode("utf-8")
