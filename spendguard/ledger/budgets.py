"""What the budgets section keeps in the ledger: per-key token budgets (overrides of the fleet
default), and the usage a lost Redis bucket is rebuilt from (the inference records)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..clock import to_micros, utcnow
from ..usage import Usage
from .database import LedgerDatabase, _text
from .schema import budget_overrides, customer_balances, records


@dataclass(frozen=True, slots=True)
class BudgetOverride:
    """A key's own ``max_tokens`` over a rolling ``budget_window`` (``24h``, ``7d``, ...)."""

    team: str  # encoded ids
    api_key: str
    team_id: str  # as the host app gave them
    api_key_id: str
    max_tokens: int
    budget_window: str


@dataclass(frozen=True, slots=True)
class UsedSlice:
    """The usage of one model's charged records that started in one slice of a window."""

    start_us: int
    model: str
    usage: Usage
    requests: int = 0  # how many records


class BudgetQueries(LedgerDatabase):
    async def set_budget_override(
        self, override: BudgetOverride, *, now: datetime | None = None
    ) -> None:
        if override.max_tokens <= 0:
            raise ValueError("max_tokens_budget must be positive")
        values = {
            "team_id": _text(override.team_id),
            "api_key_id": _text(override.api_key_id),
            "max_tokens": override.max_tokens,
            "budget_window": override.budget_window,
            "updated_us": to_micros(now or utcnow()),
        }
        stmt = self._insert(budget_overrides).values(
            team=override.team, api_key=override.api_key, **values
        )
        stmt = stmt.on_conflict_do_update(index_elements=["team", "api_key"], set_=values)
        async with self._guard("budget override write"):
            await self._db.execute(stmt)

    async def remove_budget_override(self, team: str, api_key: str) -> bool:
        where = (budget_overrides.c.team == team, budget_overrides.c.api_key == api_key)
        async with self._guard("budget override removal"), self._db.transaction():
            found = await self._db.fetch_one(sa.select(budget_overrides.c.team).where(*where))
            if found is None:
                return False
            await self._db.execute(budget_overrides.delete().where(*where))
        return True

    async def budget_override(self, team: str, api_key: str) -> BudgetOverride | None:
        async with self._guard("budget override read"):
            row = await self._db.fetch_one(
                sa.select(budget_overrides).where(
                    budget_overrides.c.team == team, budget_overrides.c.api_key == api_key
                )
            )
        return None if row is None else _override_of(row._mapping)

    async def budget_overrides(self) -> list[BudgetOverride]:
        async with self._guard("budget override list"):
            rows = await self._db.fetch_all(
                sa.select(budget_overrides).order_by(
                    budget_overrides.c.team, budget_overrides.c.api_key
                )
            )
        return [_override_of(r._mapping) for r in rows]

    async def topup_customer(
        self, customer: str, customer_id: str, micros: int, *, now: datetime | None = None
    ) -> int:
        """Add ``micros`` to a customer's prepaid account (made by its first top-up); returns
        what it was topped up with in all."""
        now_us = to_micros(now or utcnow())
        row = customer_balances.c
        stmt = self._insert(customer_balances).values(
            customer=customer,
            customer_id=_text(customer_id),
            topped_up_micros=micros,
            updated_us=now_us,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=["customer"],
            set_={
                "topped_up_micros": row.topped_up_micros + stmt.excluded.topped_up_micros,
                "updated_us": stmt.excluded.updated_us,
            },
        )
        async with self._guard("customer top-up"), self._db.transaction():
            await self._db.execute(stmt)
            total = await self._db.fetch_val(
                sa.select(row.topped_up_micros).where(row.customer == customer)
            )
        return int(total)

    async def customer_topped_up(self, customer: str) -> int | None:
        """What a customer's prepaid account was topped up with (None: it has none)."""
        row = customer_balances.c
        async with self._guard("customer balance read"):
            found = await self._db.fetch_val(
                sa.select(row.topped_up_micros).where(row.customer == customer)
            )
        return None if found is None else int(found)

    async def used_slices(
        self,
        *,
        since: datetime,
        slice_us: int,
        team: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        end_user: str | None = None,
        tag: str | None = None,
        customer: str | None = None,
    ) -> list[UsedSlice]:
        """Usage of charged (2xx) records with ``t0`` from ``since``, summed per slice of
        ``slice_us`` (by start) and model: of one key, one end user (of ``team``), one tag,
        one model or everyone (ids encoded)."""
        query = used_slices_query(
            since=since,
            slice_us=slice_us,
            postgres=self.is_postgres,
            team=team,
            api_key=api_key,
            model=model,
            end_user=end_user,
            tag=tag,
            customer=customer,
        )
        async with self._guard("budget usage read"):
            rows = await self._db.fetch_all(query)
        return [
            UsedSlice(
                int(r[0]), str(r[1]), Usage(int(r[2]), int(r[3]), int(r[4]), int(r[5])), int(r[6])
            )
            for r in rows
        ]


def used_slices_query(
    *,
    since: datetime,
    slice_us: int,
    postgres: bool,
    team: str | None = None,
    api_key: str | None = None,
    model: str | None = None,
    end_user: str | None = None,
    tag: str | None = None,
    customer: str | None = None,
) -> sa.Select[Any]:
    """:meth:`BudgetQueries.used_slices`'s query: one indexed range of the records (schema:
    the ``spendguard_records_*_t0`` indexes)."""
    # Integer division on both backends (SQLAlchemy renders // as / for integers there);
    # t0 is positive, so it truncates to the slice's start.
    start = (records.c.t0_us // slice_us) * slice_us
    query = (
        sa.select(
            start.label("start"),
            records.c.model,
            sa.func.sum(records.c.input_tokens),
            sa.func.sum(records.c.output_tokens),
            sa.func.sum(records.c.cached_input_tokens),
            sa.func.sum(records.c.cache_write_tokens),
            sa.func.count(),
        )
        .where(
            records.c.t0_us >= to_micros(since),
            records.c.status_code >= 200,
            records.c.status_code < 300,
        )
        .group_by(start, records.c.model)
    )
    if team is not None:
        query = query.where(records.c.team == team)
    if api_key is not None:
        query = query.where(records.c.api_key == api_key)
    if model is not None:
        query = query.where(records.c.model == model)
    if end_user is not None:
        query = query.where(records.c.end_user == end_user)
    if customer is not None:
        query = query.where(records.c.customer == customer)
    if tag is not None:  # found by position, not LIKE: an encoded tag may hold a %
        find = sa.func.strpos if postgres else sa.func.instr
        query = query.where(find(records.c.tags, f",{tag},") > 0)
    return query


def _override_of(m: object) -> BudgetOverride:
    row: dict[str, object] = dict(m)  # type: ignore[call-overload]
    return BudgetOverride(
        team=str(row["team"]),
        api_key=str(row["api_key"]),
        team_id=str(row["team_id"]),
        api_key_id=str(row["api_key_id"]),
        max_tokens=int(row["max_tokens"]),  # type: ignore[call-overload]
        budget_window=str(row["budget_window"]),
    )
