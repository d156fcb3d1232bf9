"""Settlement: turning unsettled records into charges, in one transaction per batch.

One batch claims records, prices each, writes one charge per record (the charge's primary key
is the record, so nothing is charged twice), adds each charge to the aggregates of the limits
that have a policy and cover it, debits the teams' prepaid accounts and marks the records
settled. Either all of it commits or none of it does. Each step is one fixed statement per
backend for the whole batch, sent straight to the driver (:mod:`.settlement_sql`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache

from .. import metrics
from ..clock import from_micros, to_micros, utcnow
from ..limits import Limit, Period, SubjectKind, Window
from ..record import PostflightStatus
from .database import LedgerDatabase
from .journal import JournalEntry, SettledRecord, encode_journal
from .policies import _limit_columns, _limit_of
from .settlement_sql import (
    AggregateRow,
    Charge,
    OverLimit,
    PostgresSettlement,
    Row,
    SettlementSql,
    SqliteSettlement,
)

_DAY_US = 86_400_000_000


@dataclass(slots=True)
class RecordRow:
    """An unsettled record as settlement claims it: what pricing needs. Built for every
    record of every batch, so plain slots (a frozen dataclass's ``__init__`` costs four times
    as much) and ``t0`` made only when asked."""

    id: str
    team: str
    api_key: str | None
    model: str
    t0_us: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    cache_write_tokens: int
    estimate_micros: int
    postflight: str
    price: str | None  # as the record carries it (None: a record of an earlier release)

    @property
    def t0(self) -> datetime:
        return from_micros(self.t0_us)


@dataclass(slots=True)
class Settlement:
    """What one settlement transaction committed."""

    charged: int = 0  # records charged
    total_micros: int = 0
    records: dict[str, list[SettledRecord]] = field(default_factory=dict)  # by team
    estimate_error_micros: int = 0  # sum of (charge - estimate)
    claimed: int = 0  # records marked settled: the charged ones and any already charged
    seq: int | None = None  # the batch's journal row
    # Micro-USD beyond a limit's amount (or below a prepaid balance's zero) that this batch's
    # charges added, by (kind, period): ("team" | "api_key", "day" | "month") or ("balance",
    # "none"), as spendguard_overspend_micros_total labels it.
    overspend: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(slots=True)
class _Claimed:
    """A batch of claimed records, priced. Per record (same order): its price and its UTC day
    (every window a record counts in is decided by its t0, however late it settles)."""

    rows: list[RecordRow] = field(default_factory=list)
    amounts: list[int] = field(default_factory=list)
    days: list[int] = field(default_factory=list)  # days since the epoch, UTC
    charges: list[Charge] = field(default_factory=list)  # those to write


class SettlementQueries(LedgerDatabase):
    @property
    def _settlement_sql(self) -> SettlementSql:
        return _POSTGRES if self.is_postgres else _SQLITE

    async def settle(
        self, batch_size: int, price: Callable[[RecordRow], int], now: datetime | None = None
    ) -> Settlement:
        """Settle up to ``batch_size`` records in ONE transaction.

        Every step is one statement for the whole batch, however many records and aggregate
        rows it covers. On PostgreSQL the claim skips rows another worker holds, so concurrent
        workers never settle one record twice.
        """
        now_us = to_micros(now or utcnow())
        sql = self._settlement_sql
        async with self._guard("settlement"), self._db.transaction():
            conn = self._db.connection().raw_connection
            await sql.lock_for_write(conn)
            rows, charged_before = await sql.claim(conn, batch_size)
            if not rows:
                return Settlement()
            claimed = _price(rows, price, charged_before)
            charged_before |= await sql.insert_charges(conn, claimed.charges, now_us)
            teams = sorted({r.team for r in claimed.rows})
            # Before reading the policies: a policy activated concurrently either sees this
            # batch's charges when it rebuilds its aggregate, or is seen here, never neither.
            # The charges may precede the lock: the rebuild sums committed charges only, and
            # this transaction commits after its policy read.
            await sql.lock_teams(conn, teams)
            bearing = _bearing(await sql.bearing(conn, teams))
            deltas, debits = _sums(claimed, bearing, charged_before)
            started = time.perf_counter()
            over = await sql.add_to_aggregates(conn, deltas, now_us)
            metrics.AGGREGATE_UPDATE_SECONDS.observe(time.perf_counter() - started)
            overdrawn = await sql.debit(conn, debits, now_us)
            settlement, journal = _settlement(claimed, charged_before)
            settlement.overspend = _overspend(over, overdrawn)
            # Last, so its number is taken as close to the commit as can be (design.md,
            # "Settlement": the cache sync follows these rows in number order).
            settlement.seq = await sql.journal(conn, now_us, journal)
        return settlement


_POSTGRES = PostgresSettlement()
_SQLITE = SqliteSettlement()


def _price(rows: Sequence[Row], price: Callable[[RecordRow], int], skip: set[str]) -> _Claimed:
    """Price each claimed record (columns in ``CLAIMED_COLUMNS`` order) and lay out the charges
    to write: one per record, except for the records in ``skip``, whose charge exists
    already. This runs for every record settled, so it is one pass making two objects per
    record: the row the price callable takes and the charge's tuple."""
    out = _Claimed()
    charges = out.charges
    rows_out, amounts, days = out.rows, out.amounts, out.days
    for row in rows:
        rec = RecordRow(
            row[0], row[1], row[2] or None, row[3], row[4], row[5], row[6], row[7], row[8],
            row[9], row[10], row[11],
        )  # fmt: skip
        amount = price(rec)
        day = rec.t0_us // _DAY_US
        rows_out.append(rec)
        amounts.append(amount)
        days.append(day)
        if skip and rec.id in skip:
            continue
        day_id, month_id = _calendar_ids(day)
        charges.append((rec.id, rec.team, row[2], rec.model, day_id, month_id, amount))
    return out


def _bearing(rows: Sequence[Row]) -> dict[str, list[Limit]]:
    """The limits with an active policy, by team: only they keep aggregates."""
    out: dict[str, list[Limit]] = defaultdict(list)
    for team, key, period in rows:
        try:
            out[team].append(_limit_of(team, key, period))
        except ValueError:
            # A window this version can't read (written by a newer one): no aggregate of it is
            # kept here, and the records still settle.
            continue
    return out


def _sums(
    claimed: _Claimed, bearing: dict[str, list[Limit]], skip: set[str]
) -> tuple[list[AggregateRow], dict[str, int]]:
    """What the charges written add to each aggregate row, in key order (so two workers lock
    shared rows in the same order), and what they debit from each team's account."""
    per_day: dict[tuple[str, str | None, int], int] = defaultdict(int)
    debits: dict[str, int] = defaultdict(int)
    for rec, amount, day in zip(claimed.rows, claimed.amounts, claimed.days, strict=True):
        if skip and rec.id in skip:
            continue
        per_day[(rec.team, rec.api_key, day)] += amount
        debits[rec.team] += amount
    # Summed per (team, key, day) first: a window's bucket depends only on the UTC date.
    deltas: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for (team, api_key, day), amount in per_day.items():
        for limit in bearing.get(team, ()):
            if limit.subject.covers(api_key):
                cols = _limit_columns(limit)
                key = (team, cols["api_key"], cols["period"], _bucket(limit.window, day))
                deltas[key] += amount
    rows = [(*key, amount) for key, amount in sorted(deltas.items())]
    return rows, dict(debits)


def _overspend(over: list[OverLimit], overdrawn: list[int]) -> dict[tuple[str, str], int]:
    """The batch's spend beyond limits and balances, by (kind, period) as the overspend
    metric labels it."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for api_key, period, beyond in over:
        out[((SubjectKind.API_KEY if api_key else SubjectKind.TEAM).value, period)] += beyond
    if overdrawn:
        out[("balance", "none")] += sum(overdrawn)
    return dict(out)


def _settlement(claimed: _Claimed, skip: set[str]) -> tuple[Settlement, str]:
    """What the batch committed, and its journal row (every record it settled, charged now or
    before). A record whose charge existed already counts as settled (its estimate leaves the
    cache) but adds no money: its charge was counted when written."""
    out = Settlement(claimed=len(claimed.rows))
    by_team = out.records
    entries: dict[str, list[JournalEntry]] = {}
    unknown = PostflightStatus.UNKNOWN.value
    charged = total = error = 0
    for rec, amount in zip(claimed.rows, claimed.amounts, strict=True):
        is_unknown = rec.postflight == unknown
        settled = SettledRecord(rec.id, rec.team, rec.api_key, rec.t0, is_unknown)
        entry: JournalEntry = [rec.id, rec.api_key or "", rec.t0_us, 1 if is_unknown else 0]
        team_records = by_team.get(rec.team)
        if team_records is None:
            by_team[rec.team] = [settled]
            entries[rec.team] = [entry]
        else:
            team_records.append(settled)
            entries[rec.team].append(entry)
        if skip and rec.id in skip:
            continue
        charged += 1
        total += amount
        error += amount - rec.estimate_micros
    out.charged, out.total_micros, out.estimate_error_micros = charged, total, error
    return out, encode_journal(entries)


@lru_cache(maxsize=1024)
def _calendar_ids(day: int) -> tuple[str, str]:
    """A charge's day and month buckets, by its UTC day (few distinct days per batch)."""
    t0 = from_micros(day * _DAY_US)
    return Period.DAY.bucket(t0), Period.MONTH.bucket(t0)


@lru_cache(maxsize=1024)
def _bucket(window: Window, day: int) -> str:
    """``window``'s bucket for any time of a UTC day: calendar windows split at midnight."""
    return window.bucket(from_micros(day * _DAY_US))
