"""Prepaid accounts: a team's top-ups and the charges settled against them.

An account is optional; a team without one is not balance-limited. Settlement debits accounts
(see :mod:`spendguard.ledger.settlement`); this module opens, tops up and reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from ..clock import to_micros, utcnow
from .database import LedgerDatabase, _text, _tuples
from .schema import balances, topups


@dataclass(frozen=True, slots=True)
class Account:
    """A team's prepaid account in micro-USD. Both totals only grow, so of two reads the one
    with the larger totals is the newer."""

    team: str
    topped_up: int
    charged: int  # settled charges since the account was opened
    hard: bool = False  # a request is admitted only if its worst case fits what is left

    @property
    def balance(self) -> int:
        return self.topped_up - self.charged


class BalanceQueries(LedgerDatabase):
    async def load_balance(self, team: str) -> Account | None:
        """The team's account; None: it has none."""
        async with self._guard("balance read"):
            row = await self._db.fetch_one(
                sa.select(
                    balances.c.topped_up_micros, balances.c.charged_micros, balances.c.hard
                ).where(balances.c.team == team)
            )
        return None if row is None else Account(team, int(row[0]), int(row[1]), bool(row[2]))

    async def set_balance_mode(self, team: str, *, hard: bool) -> Account | None:
        """Make the team's account hard or soft; None when it has no account."""
        async with self._guard("balance write"):
            await self._db.execute(
                balances.update()
                .where(balances.c.team == team)
                .values(hard=hard, updated_us=to_micros(utcnow()))
            )
        return await self.load_balance(team)

    async def topup(
        self, *, team: str, team_id: str, micros: int, now: datetime | None = None
    ) -> Account:
        """Add prepaid credit (opening the account on the first top-up); returns the account."""
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
        assert account is not None  # just opened or topped up, and accounts are never deleted
        return account

    async def balance_accounts(self, teams: Sequence[str] | None = None) -> dict[str, Account]:
        """Every account (or those of ``teams``), by team. The worker's cache sync raises the
        cached balances to these."""
        query = sa.select(
            balances.c.team, balances.c.topped_up_micros, balances.c.charged_micros, balances.c.hard
        )
        if teams is not None:
            query = query.where(balances.c.team.in_(list(teams)))
        async with self._guard("balance read"):
            rows = await self._db.fetch_all(query)
        return {t: Account(t, int(a), int(c), bool(h)) for t, a, c, h in _tuples(rows)}

    async def topped_up_since(self, since_us: int) -> dict[str, int]:
        """Teams topped up at or after ``since_us`` (by anyone, e.g. the CLI), with the time of
        their latest top-up."""
        query = (
            sa.select(topups.c.team, sa.func.max(topups.c.at_us))
            .where(topups.c.at_us >= since_us)
            .group_by(topups.c.team)
        )
        async with self._guard("balance read"):
            rows = await self._db.fetch_all(query)
        return {team: int(at) for team, at in _tuples(rows)}
