"""The SQL ledger: every query spendguard runs lives in this module.

It sits on ``databases`` (asyncio, SQLAlchemy Core) and works on SQLite and PostgreSQL. Callers
see plain Python values and :class:`LedgerUnavailable` for any database failure.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from databases import Database
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

from .. import metrics
from ..errors import LedgerUnavailable
from ..keys import BALANCE_FIELD, Scope, policy_field
from ..periods import Period, from_micros, period_id, to_micros, utcnow
from ..record import InferenceRecord
from .schema import aggregates, balances, charges, metadata, policies, records, topups

log = logging.getLogger("spendguard.ledger")

_ROWS_PER_INSERT = 500  # keeps a multi-row INSERT under SQLite's and asyncpg's parameter caps
_SCHEMA_LOCK = 0x5E9D6A4D  # an arbitrary, fixed advisory-lock id for schema creation


@dataclass(frozen=True, slots=True)
class PolicyRow:
    team: str
    api_key: str | None
    period: Period
    team_id: str
    api_key_id: str | None
    limit_micros: int
    active: bool

    @property
    def field(self) -> str:
        scope = Scope.TEAM if self.api_key is None else Scope.API_KEY
        return policy_field(scope, self.period, self.api_key)


@dataclass(frozen=True, slots=True)
class RecordRow:
    id: str
    team: str
    api_key: str | None
    model: str
    t0: datetime
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    cache_write_tokens: int
    estimate_micros: int
    postflight: str


@dataclass(frozen=True, slots=True)
class SettledRecord:
    """What a cache refresh needs to know of a settled record: which keys it touched."""

    id: str
    api_key: str | None
    day_id: str
    month_id: str
    unknown: bool  # its postflight outcome was unknown


@dataclass(slots=True)
class Settlement:
    """What one settlement transaction committed."""

    charged: int = 0  # records settled
    total_micros: int = 0
    records: dict[str, list[SettledRecord]] = field(default_factory=dict)  # by team
    estimate_error_micros: int = 0  # sum of (charge - estimate)


@dataclass(frozen=True, slots=True)
class SpendRow:
    api_key: str | None
    api_key_id: str | None
    period: Period
    period_id: str
    spent_micros: int


def _key_or_none(value: str) -> str | None:
    return value or None


class Ledger:
    def __init__(self, url: str) -> None:
        self.url = url
        self.is_postgres = url.startswith(("postgres", "postgresql"))
        self._db = Database(url)
        self._insert: Any = postgresql.insert if self.is_postgres else sqlite.insert

    # -- lifecycle ----------------------------------------------------------------------
    async def connect(self) -> None:
        try:
            await self._db.connect()
        except Exception as exc:
            raise LedgerUnavailable(f"cannot connect to the ledger database: {exc}") from exc

    async def disconnect(self) -> None:
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
        except Exception as exc:  # driver errors differ per backend; callers need one type
            self._forget_connection()
            raise LedgerUnavailable(f"ledger {what} failed: {exc!r}") from exc

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
            await self._db.fetch_val(sa.select(sa.literal(1)))

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
            for index in table.indexes:
                await self._db.execute(
                    str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect))
                )

    # -- policies -------------------------------------------------------------------------
    async def set_policy(
        self,
        *,
        team: str,
        team_id: str,
        api_key: str | None,
        api_key_id: str | None,
        period: Period,
        limit_micros: int,
        now: datetime | None = None,
    ) -> PolicyRow:
        """Create, change or reactivate a policy (R9.1).

        A new or reactivated policy's current-period aggregate is rebuilt from the period's
        charges in the same transaction, so spend that happened before the policy existed
        counts against it exactly once. Changing the amount of an active policy keeps it.
        """
        if limit_micros < 0:
            raise ValueError("limit must be >= 0")
        now = now or utcnow()
        now_us = to_micros(now)
        key = api_key or ""
        async with self._guard("policy write"), self._db.transaction():
            await self._lock_for_write()
            await self._lock_teams([team])
            existing = await self._db.fetch_one(
                sa.select(policies.c.active).where(
                    policies.c.team == team, policies.c.api_key == key, policies.c.period == period
                )
            )
            stmt = self._insert(policies).values(
                team=team,
                api_key=key,
                period=period.value,
                team_id=_text(team_id),
                api_key_id=_text(api_key_id),
                limit_micros=limit_micros,
                active=True,
                created_us=now_us,
                updated_us=now_us,
            )
            stmt = stmt.on_conflict_do_update(
                index_elements=[policies.c.team, policies.c.api_key, policies.c.period],
                set_={
                    "limit_micros": stmt.excluded.limit_micros,
                    "active": True,
                    "updated_us": stmt.excluded.updated_us,
                },
            )
            await self._db.execute(stmt)
            if existing is None or not existing[0]:
                await self._rebuild_aggregate(team, key, period, period_id(period, now), now_us)
        return PolicyRow(team, api_key, period, team_id, api_key_id, limit_micros, True)

    async def _rebuild_aggregate(
        self, team: str, key: str, period: Period, pid: str, now_us: int
    ) -> None:
        column = charges.c.day_id if period is Period.DAY else charges.c.month_id
        conds = [charges.c.team == team, column == pid]
        if key:
            conds.append(charges.c.api_key == key)
        total = await self._db.fetch_val(
            sa.select(sa.func.coalesce(sa.func.sum(charges.c.amount_micros), 0)).where(*conds)
        )
        stmt = self._insert(aggregates).values(
            team=team,
            api_key=key,
            period=period.value,
            period_id=pid,
            settled_micros=int(total),
            updated_us=now_us,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[
                aggregates.c.team,
                aggregates.c.api_key,
                aggregates.c.period,
                aggregates.c.period_id,
            ],
            set_={"settled_micros": stmt.excluded.settled_micros, "updated_us": now_us},
        )
        await self._db.execute(stmt)

    async def remove_policy(self, *, team: str, api_key: str | None, period: Period) -> bool:
        """Deactivate a policy (kept for history); returns whether an active one existed."""
        async with self._guard("policy write"):
            row = await self._db.fetch_one(
                sa.select(policies.c.active).where(
                    policies.c.team == team,
                    policies.c.api_key == (api_key or ""),
                    policies.c.period == period.value,
                )
            )
            if row is None or not row[0]:
                return False
            await self._db.execute(
                policies.update()
                .where(
                    policies.c.team == team,
                    policies.c.api_key == (api_key or ""),
                    policies.c.period == period.value,
                )
                .values(active=False, updated_us=to_micros(utcnow()))
            )
            return True

    async def list_policies(self, team: str | None = None) -> list[PolicyRow]:
        query = sa.select(policies).where(policies.c.active == sa.true())
        if team is not None:
            query = query.where(policies.c.team == team)
        query = query.order_by(policies.c.team, policies.c.api_key, policies.c.period)
        async with self._guard("policy read"):
            rows = await self._db.fetch_all(query)
        return [_policy_row(r._mapping) for r in rows]

    async def load_policies(self, team: str) -> dict[str, int]:
        """The team's active policies as cache hash fields (empty: no policy), plus the
        balance marker when the team has a prepaid account."""
        fields = {p.field: p.limit_micros for p in await self.list_policies(team)}
        if await self.load_balance(team) is not None:
            fields[BALANCE_FIELD] = 1
        return fields

    # -- balances -------------------------------------------------------------------------
    async def load_balance(self, team: str) -> tuple[int, int] | None:
        """(topped up, charged) micro-USD of the team's account; None: no account."""
        async with self._guard("balance read"):
            row = await self._db.fetch_one(
                sa.select(balances.c.topped_up_micros, balances.c.charged_micros).where(
                    balances.c.team == team
                )
            )
        return None if row is None else (int(row[0]), int(row[1]))

    async def topup(
        self, *, team: str, team_id: str, micros: int, now: datetime | None = None
    ) -> tuple[int, int]:
        """Add prepaid credit (creating the account on first top-up); returns the account."""
        if micros <= 0:
            raise ValueError("a top-up must be positive")
        now_us = to_micros(now or utcnow())
        async with self._guard("top-up"), self._db.transaction():
            await self._lock_for_write()
            await self._lock_teams([team])
            stmt = self._insert(balances).values(
                team=team,
                team_id=_text(team_id),
                topped_up_micros=micros,
                charged_micros=0,
                created_us=now_us,
                updated_us=now_us,
            )
            await self._db.execute(
                stmt.on_conflict_do_update(
                    index_elements=[balances.c.team],
                    set_={
                        "topped_up_micros": balances.c.topped_up_micros + micros,
                        "updated_us": now_us,
                    },
                )
            )
            await self._db.execute(
                topups.insert().values(team=team, amount_micros=micros, at_us=now_us)
            )
        account = await self.load_balance(team)
        assert account is not None
        return account

    async def balance_accounts(self) -> dict[str, tuple[int, int]]:
        """Every account: team -> (topped up, charged). Used by the self-healing refresh."""
        async with self._guard("balance read"):
            rows = await self._db.fetch_all(
                sa.select(balances.c.team, balances.c.topped_up_micros, balances.c.charged_micros)
            )
        return {t: (int(a), int(b)) for t, a, b in _tuples(rows)}

    async def topups_total(self, team: str) -> int:
        async with self._guard("top-up read"):
            total = await self._db.fetch_val(
                sa.select(sa.func.coalesce(sa.func.sum(topups.c.amount_micros), 0)).where(
                    topups.c.team == team
                )
            )
        return int(total)

    async def load_aggregates(
        self, team: str, wanted: Iterable[tuple[str | None, Period, str]]
    ) -> dict[tuple[str | None, Period, str], int]:
        """Settled micro-USD for (api_key, period, period_id) of one team; 0 when absent."""
        wanted = list(wanted)
        if not wanted:
            return {}
        conds = [
            sa.and_(
                aggregates.c.api_key == (key or ""),
                aggregates.c.period == period.value,
                aggregates.c.period_id == pid,
            )
            for key, period, pid in wanted
        ]
        query = sa.select(
            aggregates.c.api_key,
            aggregates.c.period,
            aggregates.c.period_id,
            aggregates.c.settled_micros,
        ).where(aggregates.c.team == team, sa.or_(*conds))
        async with self._guard("aggregate read"):
            rows = await self._db.fetch_all(query)
        found = {(_key_or_none(r[0]), Period(r[1]), r[2]): int(r[3]) for r in rows}
        return {w: found.get(w, 0) for w in wanted}

    # -- records --------------------------------------------------------------------------
    async def insert_records(self, batch: Sequence[InferenceRecord]) -> None:
        """Write records idempotently: a record re-sent after an unknown outcome is kept once."""
        if not batch:
            return
        now_us = to_micros(utcnow())
        rows = [_record_values(r, now_us) for r in batch]
        async with self._guard("record write"), self._db.transaction():
            for start in range(0, len(rows), _ROWS_PER_INSERT):
                chunk = rows[start : start + _ROWS_PER_INSERT]
                stmt = (
                    self._insert(records)
                    .values(chunk)
                    .on_conflict_do_nothing(index_elements=[records.c.id])
                )
                await self._db.execute(stmt)

    # -- settlement -----------------------------------------------------------------------
    async def settle(
        self, batch_size: int, price: Callable[[RecordRow], int], now: datetime | None = None
    ) -> Settlement:
        """Settle up to ``batch_size`` records in ONE transaction (R7.2).

        Charges are inserted (one per record, by primary key), added to the aggregates of the
        policy-bearing scopes of each record's ``t0`` periods with one UPDATE per aggregate row
        (R7.7), and the records marked settled. On PostgreSQL the claim skips rows another
        worker holds, so concurrent workers never settle one record twice.
        """
        now_us = to_micros(now or utcnow())
        out = Settlement()
        claim = (
            sa.select(
                records.c.id,
                records.c.team,
                records.c.api_key,
                records.c.model,
                records.c.t0_us,
                records.c.input_tokens,
                records.c.output_tokens,
                records.c.cached_input_tokens,
                records.c.cache_write_tokens,
                records.c.estimate_micros,
                records.c.postflight,
            )
            .where(records.c.settled == sa.false())
            .order_by(records.c.created_us, records.c.id)
            .limit(batch_size)
        )
        if self.is_postgres:
            claim = claim.with_for_update(skip_locked=True)
        async with self._guard("settlement"), self._db.transaction():
            await self._lock_for_write()
            rows = [
                RecordRow(
                    id=r[0],
                    team=r[1],
                    api_key=_key_or_none(r[2]),
                    model=r[3],
                    t0=from_micros(int(r[4])),
                    input_tokens=int(r[5]),
                    output_tokens=int(r[6]),
                    cached_input_tokens=int(r[7]),
                    cache_write_tokens=int(r[8]),
                    estimate_micros=int(r[9]),
                    postflight=r[10],
                )
                for r in await self._db.fetch_all(claim)
            ]
            if not rows:
                return out
            teams = sorted({r.team for r in rows})
            await self._lock_teams(teams)
            active = await self._db.fetch_all(
                sa.select(policies.c.team, policies.c.api_key, policies.c.period).where(
                    policies.c.team.in_(teams), policies.c.active == sa.true()
                )
            )
            bearing: dict[str, set[tuple[str, str]]] = defaultdict(set)
            for team, key, period in _tuples(active):
                bearing[team].add((key, period))

            charge_rows = []
            per_team: dict[str, int] = defaultdict(int)
            deltas: dict[tuple[str, str, str, str], int] = defaultdict(int)
            for rec in rows:
                amount = price(rec)
                per_team[rec.team] += amount
                key = rec.api_key or ""
                day, month = period_id(Period.DAY, rec.t0), period_id(Period.MONTH, rec.t0)
                charge_rows.append(
                    {
                        "record_id": rec.id,
                        "team": rec.team,
                        "api_key": key,
                        "model": rec.model,
                        "day_id": day,
                        "month_id": month,
                        "amount_micros": amount,
                        "settled_us": now_us,
                    }
                )
                for scope_key in {"", key}:
                    for period, pid in (("day", day), ("month", month)):
                        if (scope_key, period) in bearing[rec.team]:
                            deltas[(rec.team, scope_key, period, pid)] += amount
                out.charged += 1
                out.total_micros += amount
                out.estimate_error_micros += amount - rec.estimate_micros
                out.records.setdefault(rec.team, []).append(
                    SettledRecord(rec.id, rec.api_key, day, month, rec.postflight == "unknown")
                )

            for start in range(0, len(charge_rows), _ROWS_PER_INSERT):
                await self._db.execute(
                    self._insert(charges)
                    .values(charge_rows[start : start + _ROWS_PER_INSERT])
                    .on_conflict_do_nothing(index_elements=[charges.c.record_id])
                )
            for (team, key, period, pid), delta in sorted(deltas.items()):
                started = time.perf_counter()
                stmt = self._insert(aggregates).values(
                    team=team,
                    api_key=key,
                    period=period,
                    period_id=pid,
                    settled_micros=delta,
                    updated_us=now_us,
                )
                await self._db.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[
                            aggregates.c.team,
                            aggregates.c.api_key,
                            aggregates.c.period,
                            aggregates.c.period_id,
                        ],
                        set_={
                            "settled_micros": aggregates.c.settled_micros + delta,
                            "updated_us": now_us,
                        },
                    )
                )
                metrics.AGGREGATE_UPDATE_SECONDS.observe(time.perf_counter() - started)
            for team, amount in sorted(per_team.items()):
                # Teams without an account match no row: not balance-limited.
                await self._db.execute(
                    balances.update()
                    .where(balances.c.team == team)
                    .values(charged_micros=balances.c.charged_micros + amount, updated_us=now_us)
                )
            ids = [r.id for r in rows]
            for start in range(0, len(ids), _ROWS_PER_INSERT):
                await self._db.execute(
                    records.update()
                    .where(records.c.id.in_(ids[start : start + _ROWS_PER_INSERT]))
                    .values(settled=True)
                )
        return out

    async def policy_aggregates(
        self, day_id: str, month_id: str, teams: Sequence[str] | None = None
    ) -> dict[str, list[tuple[str, str, int]]]:
        """For every team with active policies: (policy field, period_id, settled) of the given
        day and month, 0 where no aggregate row exists yet. Used by the self-healing refresh."""
        query = (
            sa.select(
                policies.c.team,
                policies.c.api_key,
                policies.c.period,
                aggregates.c.settled_micros,
            )
            .select_from(
                policies.outerjoin(
                    aggregates,
                    sa.and_(
                        aggregates.c.team == policies.c.team,
                        aggregates.c.api_key == policies.c.api_key,
                        aggregates.c.period == policies.c.period,
                        aggregates.c.period_id
                        == sa.case((policies.c.period == "day", day_id), else_=month_id),
                    ),
                )
            )
            .where(policies.c.active == sa.true())
        )
        if teams is not None:
            query = query.where(policies.c.team.in_(list(teams)))
        async with self._guard("aggregate read"):
            rows = await self._db.fetch_all(query)
        out: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
        for team, key, period_name, settled in _tuples(rows):
            period = Period(period_name)
            scope = Scope.API_KEY if key else Scope.TEAM
            pid = day_id if period is Period.DAY else month_id
            out[team].append((policy_field(scope, period, key or None), pid, int(settled or 0)))
        return dict(out)

    async def settled_records(self, record_ids: Sequence[str]) -> dict[str, SettledRecord]:
        """Which of these records are settled (by any worker, at any time), and where."""
        out: dict[str, SettledRecord] = {}
        ids = list(dict.fromkeys(record_ids))
        async with self._guard("charge read"):
            for start in range(0, len(ids), _ROWS_PER_INSERT):
                query = (
                    sa.select(
                        charges.c.record_id,
                        charges.c.api_key,
                        charges.c.day_id,
                        charges.c.month_id,
                        records.c.postflight,
                    )
                    .select_from(charges.join(records, records.c.id == charges.c.record_id))
                    .where(charges.c.record_id.in_(ids[start : start + _ROWS_PER_INSERT]))
                )
                for rid, key, day, month, status in _tuples(await self._db.fetch_all(query)):
                    out[rid] = SettledRecord(rid, key or None, day, month, status == "unknown")
        return out

    async def policies_changed_since(self, since_us: int) -> dict[str, int]:
        """Teams whose policies changed at or after ``since_us`` (by anyone, e.g. the CLI),
        with the time of their latest change."""
        query = (
            sa.select(policies.c.team, sa.func.max(policies.c.updated_us))
            .where(policies.c.updated_us >= since_us)
            .group_by(policies.c.team)
        )
        opened = sa.select(balances.c.team, balances.c.created_us).where(
            balances.c.created_us >= since_us
        )
        async with self._guard("policy read"):
            rows = _tuples(await self._db.fetch_all(query))
            rows += _tuples(await self._db.fetch_all(opened))  # a new account: new marker
        changed: dict[str, int] = {}
        for team, at in rows:
            changed[team] = max(changed.get(team, 0), int(at))
        return changed

    # -- reports --------------------------------------------------------------------------
    async def spend(self, team: str, day_id: str, month_id: str) -> list[SpendRow]:
        """Settled spend (sum of charges) of a team per API key and in total, day and month."""
        out: list[SpendRow] = []
        async with self._guard("usage read"):
            for period, column, pid in (
                (Period.DAY, charges.c.day_id, day_id),
                (Period.MONTH, charges.c.month_id, month_id),
            ):
                rows = await self._db.fetch_all(
                    sa.select(charges.c.api_key, sa.func.sum(charges.c.amount_micros))
                    .where(charges.c.team == team, column == pid)
                    .group_by(charges.c.api_key)
                    .order_by(charges.c.api_key)
                )
                total = 0
                for key, amount in _tuples(rows):
                    total += int(amount)
                    if key:
                        out.append(SpendRow(key, None, period, pid, int(amount)))
                out.append(SpendRow(None, None, period, pid, total))
            raw = dict(
                (k, v)
                for k, v in _tuples(
                    await self._db.fetch_all(
                        sa.select(records.c.api_key, records.c.api_key_id)
                        .where(records.c.team == team)
                        .distinct()
                    )
                )
            )
        return [
            SpendRow(r.api_key, raw.get(r.api_key or ""), r.period, r.period_id, r.spent_micros)
            for r in out
        ]

    async def unsettled(self, team: str | None = None) -> tuple[int, int]:
        """(count, sum of estimates) of records not settled yet."""
        query = sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.sum(records.c.estimate_micros), 0)
        ).where(records.c.settled == sa.false())
        if team is not None:
            query = query.where(records.c.team == team)
        async with self._guard("record read"):
            row = await self._db.fetch_one(query)
        assert row is not None  # an aggregate query always returns one row
        return int(row[0]), int(row[1])

    async def charges_total(self, team: str | None = None) -> int:
        query = sa.select(sa.func.coalesce(sa.func.sum(charges.c.amount_micros), 0))
        if team is not None:
            query = query.where(charges.c.team == team)
        async with self._guard("charge read"):
            return int(await self._db.fetch_val(query))

    async def aggregate_rows(self, team: str | None = None) -> list[dict[str, Any]]:
        query = sa.select(aggregates)
        if team is not None:
            query = query.where(aggregates.c.team == team)
        async with self._guard("aggregate read"):
            return [dict(r._mapping) for r in await self._db.fetch_all(query)]


def _tuples(rows: Sequence[Any]) -> list[tuple[Any, ...]]:
    # A `databases` Record iterates over its column names, not its values.
    return [tuple(r._mapping.values()) for r in rows]


def _text(value: str | None) -> str | None:
    """Display text from the host app, made storable everywhere: PostgreSQL refuses NUL and
    lone surrogates in text, and one such record must not block the record writer."""
    if value is None:
        return None
    cleaned = value.replace("\x00", "\ufffd")
    return cleaned.encode("utf-8", "replace").decode("utf-8")


def _policy_row(m: Any) -> PolicyRow:
    return PolicyRow(
        team=m["team"],
        api_key=_key_or_none(m["api_key"]),
        period=Period(m["period"]),
        team_id=m["team_id"],
        api_key_id=m["api_key_id"],
        limit_micros=int(m["limit_micros"]),
        active=bool(m["active"]),
    )


def _record_values(r: InferenceRecord, now_us: int) -> dict[str, Any]:
    return {
        "id": r.id,
        "inference_id": r.inference_id,
        "team": r.identity.team,
        "api_key": r.identity.api_key or "",
        "team_id": _text(r.identity.team_id),
        "api_key_id": _text(r.identity.api_key_id),
        "model": _text(r.model),
        "route": _text(r.route),
        "t0_us": to_micros(r.t0),
        "status_code": r.status_code,
        "input_tokens": r.usage.input_tokens,
        "output_tokens": r.usage.output_tokens,
        "cached_input_tokens": r.usage.cached_input_tokens,
        "cache_write_tokens": r.usage.cache_write_tokens,
        "usage_estimated": r.usage.estimated,
        "estimate_micros": r.estimate_micros,
        "postflight": r.postflight.value,
        "settled": False,
        "created_us": now_us,
    }
