"""Settlement: turning unsettled records into charges, in one transaction per batch.

One batch claims records, prices each, writes one charge per record (the charge's primary key
is the record, so nothing is charged twice), adds each charge to the aggregates of the limits
that have a policy and cover it, debits the teams' prepaid accounts and marks the records
settled. Either all of it commits or none of it does.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from .. import metrics
from ..clock import from_micros, to_micros, utcnow
from ..limits import Balance, Limit, Period, Target
from ..record import PostflightStatus
from .database import ROWS_PER_STATEMENT, LedgerDatabase, _tuples
from .policies import _limit_columns, _limit_of
from .schema import aggregates, balances, charges, policies, records


@dataclass(frozen=True, slots=True)
class RecordRow:
    """An unsettled record as settlement claims it: what pricing needs."""

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
    """A settled record as a cache refresh sees it: whose usage it belongs to, and whether its
    estimate reached the cache (``unknown``: the postflight outcome was not known)."""

    id: str
    team: str
    api_key: str | None
    t0: datetime
    unknown: bool

    def counts_toward(self, target: Target, bucket: str) -> bool:
        """Whether this record's charge counts toward ``target`` in ``bucket`` (a window id;
        ignored for a balance, which has no window): a balance takes every record of its
        team; a limit takes the records its subject covers whose ``t0`` fell in ``bucket``."""
        if target.team != self.team:
            return False
        if isinstance(target, Balance):
            return True
        return target.subject.covers(self.api_key) and target.window.bucket(self.t0) == bucket


@dataclass(slots=True)
class Settlement:
    """What one settlement transaction committed."""

    charged: int = 0  # records settled
    total_micros: int = 0
    records: dict[str, list[SettledRecord]] = field(default_factory=dict)  # by team
    estimate_error_micros: int = 0  # sum of (charge - estimate)


@dataclass(slots=True)
class _Batch:
    """The writes one batch of claimed records makes."""

    charges: list[dict[str, Any]] = field(default_factory=list)  # charges rows
    deltas: dict[tuple[Limit, str], int] = field(default_factory=dict)  # per aggregate row
    debits: dict[str, int] = field(default_factory=dict)  # per team
    settlement: Settlement = field(default_factory=Settlement)


class SettlementQueries(LedgerDatabase):
    async def settle(
        self, batch_size: int, price: Callable[[RecordRow], int], now: datetime | None = None
    ) -> Settlement:
        """Settle up to ``batch_size`` records in ONE transaction.

        Each aggregate row a batch touches gets one UPDATE, however many records it sums, so a
        busy team costs one write per batch, not one per record. On PostgreSQL the claim skips
        rows another worker holds, so concurrent workers never settle one record twice.
        """
        now_us = to_micros(now or utcnow())
        async with self._guard("settlement"), self._db.transaction():
            await self._lock_for_write()
            claimed = await self._claim(batch_size)
            if not claimed:
                return Settlement()
            teams = sorted({r.team for r in claimed})
            # Before reading the policies: a policy activated concurrently either sees this
            # batch's charges when it rebuilds its aggregate, or is seen here, never neither.
            await self._lock_teams(teams)
            bearing = await self._policy_bearing_limits(teams)
            batch = _build_batch(claimed, price, bearing, now_us)
            await self._write_charges(batch.charges)
            await self._apply_deltas(batch.deltas, now_us)
            await self._debit_balances(batch.debits, now_us)
            await self._mark_settled([r.id for r in claimed])
        return batch.settlement

    async def _claim(self, batch_size: int) -> list[RecordRow]:
        """The oldest unsettled records, up to ``batch_size``."""
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
        return [
            RecordRow(
                id=r[0],
                team=r[1],
                api_key=r[2] or None,
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

    async def _policy_bearing_limits(self, teams: Sequence[str]) -> dict[str, set[Limit]]:
        """The limits of these teams that have an active policy: only they keep aggregates."""
        rows = await self._db.fetch_all(
            sa.select(policies.c.team, policies.c.api_key, policies.c.period).where(
                policies.c.team.in_(teams), policies.c.active == sa.true()
            )
        )
        bearing: dict[str, set[Limit]] = defaultdict(set)
        for team, key, period in _tuples(rows):
            try:
                bearing[team].add(_limit_of(team, key, period))
            except ValueError:
                # A window this version can't read (written by a newer one): no aggregate of
                # it is kept here, and the records still settle.
                continue
        return bearing

    async def _write_charges(self, rows: list[dict[str, Any]]) -> None:
        # A charge already there (the record settled by someone else) is left as it is.
        for start in range(0, len(rows), ROWS_PER_STATEMENT):
            await self._db.execute(
                self._insert(charges)
                .values(rows[start : start + ROWS_PER_STATEMENT])
                .on_conflict_do_nothing(index_elements=[charges.c.record_id])
            )

    async def _apply_deltas(self, deltas: dict[tuple[Limit, str], int], now_us: int) -> None:
        # Rows are written in key order, so two workers lock shared rows in the same order.
        for (limit, bucket), delta in sorted(deltas.items(), key=_aggregate_order):
            started = time.perf_counter()
            stmt = self._insert(aggregates).values(
                **_limit_columns(limit),
                period_id=bucket,
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

    async def _debit_balances(self, debits: dict[str, int], now_us: int) -> None:
        for team, amount in sorted(debits.items()):
            # Teams without an account match no row: not balance-limited.
            await self._db.execute(
                balances.update()
                .where(balances.c.team == team)
                .values(charged_micros=balances.c.charged_micros + amount, updated_us=now_us)
            )

    async def _mark_settled(self, ids: list[str]) -> None:
        for start in range(0, len(ids), ROWS_PER_STATEMENT):
            await self._db.execute(
                records.update()
                .where(records.c.id.in_(ids[start : start + ROWS_PER_STATEMENT]))
                .values(settled=True)
            )


def _build_batch(
    claimed: Iterable[RecordRow],
    price: Callable[[RecordRow], int],
    bearing: dict[str, set[Limit]],
    now_us: int,
) -> _Batch:
    """Price each claimed record and collect what the batch writes: a charge per record, the
    sum added to each aggregate row, the sum debited from each team's account."""
    batch = _Batch()
    deltas: dict[tuple[Limit, str], int] = defaultdict(int)
    debits: dict[str, int] = defaultdict(int)
    out = batch.settlement
    for rec in claimed:
        amount = price(rec)
        debits[rec.team] += amount
        batch.charges.append(
            {
                "record_id": rec.id,
                "team": rec.team,
                "api_key": rec.api_key or "",
                "model": rec.model,
                "day_id": Period.DAY.bucket(rec.t0),
                "month_id": Period.MONTH.bucket(rec.t0),
                "amount_micros": amount,
                "settled_us": now_us,
            }
        )
        # Every window a record lands in is decided by its t0, however late it settles.
        for limit in bearing.get(rec.team, ()):
            if limit.subject.covers(rec.api_key):
                deltas[(limit, limit.window.bucket(rec.t0))] += amount
        out.charged += 1
        out.total_micros += amount
        out.estimate_error_micros += amount - rec.estimate_micros
        out.records.setdefault(rec.team, []).append(
            SettledRecord(
                rec.id, rec.team, rec.api_key, rec.t0, rec.postflight == PostflightStatus.UNKNOWN
            )
        )
    batch.deltas, batch.debits = dict(deltas), dict(debits)
    return batch


def _aggregate_order(item: tuple[tuple[Limit, str], int]) -> tuple[str, str, str, str]:
    """An aggregate row's primary key: (team, api_key, period, bucket)."""
    (limit, bucket), _ = item
    cols = _limit_columns(limit)
    return cols["team"], cols["api_key"], cols["period"], bucket
