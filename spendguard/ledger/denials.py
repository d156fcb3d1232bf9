"""Recent denials (see :mod:`spendguard.engine.denials`): written in batches, read by the
reports, forgotten after a week."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import sqlalchemy as sa

from ..clock import from_micros, to_micros
from .database import LedgerDatabase, _text
from .schema import denials

if TYPE_CHECKING:
    from ..engine.denials import Denial


@dataclass(frozen=True, slots=True)
class DenialRow:
    team_id: str
    api_key_id: str | None
    kind: str
    model: str
    at: datetime


class DenialQueries(LedgerDatabase):
    async def add_denials(self, batch: Sequence[Denial]) -> None:
        rows = [
            {
                "team": d.identity.team,
                "api_key": d.identity.api_key or "",
                "team_id": _text(d.identity.team_id),
                "api_key_id": _text(d.identity.api_key_id),
                "kind": d.kind,
                "model": _text(d.model) or "",
                "at_us": to_micros(d.at),
            }
            for d in batch
        ]
        async with self._guard("denial write"):
            await self._db.execute_many(denials.insert(), rows)

    async def forget_denials(self, *, before: datetime) -> None:
        async with self._guard("denial prune"):
            await self._db.execute(denials.delete().where(denials.c.at_us < to_micros(before)))

    async def recent_denials(self, *, since: datetime, limit: int = 20) -> list[DenialRow]:
        """The newest denials since ``since``, newest first."""
        query = (
            sa.select(denials)
            .where(denials.c.at_us >= to_micros(since))
            .order_by(denials.c.at_us.desc(), denials.c.id.desc())
            .limit(limit)
        )
        async with self._guard("denial read"):
            rows = await self._db.fetch_all(query)
        return [
            DenialRow(
                str(r._mapping["team_id"]),
                r._mapping["api_key_id"],
                str(r._mapping["kind"]),
                str(r._mapping["model"]),
                from_micros(int(r._mapping["at_us"])),
            )
            for r in rows
        ]

    async def denial_counts(self, *, since: datetime) -> dict[tuple[str, str], int]:
        """Denials since ``since`` per (team, API key) (encoded ids; key '' for none)."""
        query = (
            sa.select(denials.c.team, denials.c.api_key, sa.func.count())
            .where(denials.c.at_us >= to_micros(since))
            .group_by(denials.c.team, denials.c.api_key)
        )
        async with self._guard("denial read"):
            rows = await self._db.fetch_all(query)
        return {(str(r[0]), str(r[1])): int(r[2]) for r in rows}
