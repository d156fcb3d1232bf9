"""What the budgets section keeps in the ledger: per-key token budgets (overrides of the fleet
default), and the records a lost Redis bucket is rebuilt from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from ..clock import to_micros, utcnow
from ..usage import Usage
from .database import LedgerDatabase, _text
from .schema import budget_overrides, records


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
class UsedRecord:
    """One charged record, as a budget bucket counts it."""

    t0_us: int
    model: str
    usage: Usage


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

    async def used_records(
        self,
        *,
        since: datetime,
        team: str | None = None,
        api_key: str | None = None,
        models: Sequence[str] | None = None,
    ) -> list[UsedRecord]:
        """Charged (2xx) records with ``t0`` from ``since``, of one key, some models or all."""
        query = sa.select(
            records.c.t0_us,
            records.c.model,
            records.c.input_tokens,
            records.c.output_tokens,
            records.c.cached_input_tokens,
            records.c.cache_write_tokens,
        ).where(
            records.c.t0_us >= to_micros(since),
            records.c.status_code >= 200,
            records.c.status_code < 300,
        )
        if team is not None:
            query = query.where(records.c.team == team)
        if api_key is not None:
            query = query.where(records.c.api_key == api_key)
        if models is not None:
            query = query.where(records.c.model.in_(list(models)))
        async with self._guard("budget usage read"):
            rows = await self._db.fetch_all(query)
        return [
            UsedRecord(
                int(r[0]),
                str(r[1]),
                Usage(int(r[2]), int(r[3]), int(r[4]), int(r[5])),
            )
            for r in rows
        ]


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
