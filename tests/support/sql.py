"""Reading the ledger's tables directly, as an operator would, on a connection of the test's
own: tests check the ledger without reaching into the ledger object."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from databases import Database

from spendguard.ledger.schema import charges, topups


async def sql_rows(url: str, query: Any) -> list[tuple[Any, ...]]:
    """Run one query on its own connection and return its rows as tuples."""
    db = Database(url)
    await db.connect()
    try:
        return [tuple(r._mapping.values()) for r in await db.fetch_all(query)]
    finally:
        await db.disconnect()


async def sql_execute(url: str, statement: Any) -> None:
    """Run one write on its own connection: a test sets up a state spendguard never writes."""
    db = Database(url)
    await db.connect()
    try:
        await db.execute(statement)
    finally:
        await db.disconnect()


async def sql_value(url: str, query: Any) -> Any:
    """The first column of the first row of ``query``."""
    return (await sql_rows(url, query))[0][0]


async def topups_total(url: str, team: str) -> int:
    """The sum of a team's top-ups, read from the top-up log (not the account) as a cross-check."""
    query = sa.select(sa.func.coalesce(sa.func.sum(topups.c.amount_micros), 0)).where(
        topups.c.team == team
    )
    return int(await sql_value(url, query))


async def charges_in_month(url: str, team: str, month: str) -> int:
    """An independent recomputation of a team's monthly aggregate from its charges."""
    query = sa.select(sa.func.coalesce(sa.func.sum(charges.c.amount_micros), 0)).where(
        charges.c.team == team, charges.c.month_id == month
    )
    return int(await sql_value(url, query))
