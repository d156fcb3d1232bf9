"""The settlement journal: which records each settlement transaction settled, numbered.

Every settlement transaction writes one row as its last statement (:mod:`.settlement`), in the
same transaction as its charges. A process's cache sync follows the rows by number, so a pass
reads what was settled since the last one, by anyone, instead of asking about every estimate
its cache still holds (design.md, "Settlement"). Rows are pruned after a while.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from ..clock import from_micros
from ..limits import Balance, Target
from .database import ROWS_PER_STATEMENT, LedgerDatabase, _tuples
from .schema import settlements

# One journal entry of a record: [record id, api key ('' for none), t0_us, 1 if unknown else 0].
JournalEntry = list[str | int]


@dataclass(slots=True, unsafe_hash=True)
class SettledRecord:
    """A settled record as a cache refresh sees it: whose usage it belongs to, and whether its
    estimate reached the cache (``unknown``: the postflight outcome was not known). One is made
    per record settled, so plain slots (not frozen: a frozen ``__init__`` costs four times as
    much); nothing assigns to one after it is made."""

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


def encode_journal(entries: dict[str, list[JournalEntry]]) -> str:
    """A journal row's ``records``: per team, the entries of its records."""
    return json.dumps(entries, separators=(",", ":"))


def decode_journal(text: str) -> list[SettledRecord]:
    """The records a journal row names."""
    body: dict[str, list[JournalEntry]] = json.loads(text)
    return [
        SettledRecord(str(rid), team, str(key) or None, from_micros(int(t0_us)), bool(unknown))
        for team, entries in body.items()
        for rid, key, t0_us, unknown in entries
    ]


class JournalQueries(LedgerDatabase):
    async def journal_head(self) -> int:
        """The number of the newest journal row (0: none yet)."""
        query = sa.select(sa.func.coalesce(sa.func.max(settlements.c.seq), 0))
        async with self._guard("journal read"):
            return int(await self._db.fetch_val(query))

    async def journal_after(self, after: int, limit: int) -> list[int]:
        """The numbers of the (committed) journal rows after ``after``, up to ``limit``."""
        query = (
            sa.select(settlements.c.seq)
            .where(settlements.c.seq > after)
            .order_by(settlements.c.seq)
            .limit(limit)
        )
        async with self._guard("journal read"):
            return [int(row[0]) for row in _tuples(await self._db.fetch_all(query))]

    async def journal_records(self, seqs: Sequence[int]) -> dict[int, list[SettledRecord]]:
        """The records each of these journal rows settled (rows not committed, or pruned, are
        absent)."""
        out: dict[int, list[SettledRecord]] = {}
        wanted = sorted(set(seqs))
        async with self._guard("journal read"):
            for start in range(0, len(wanted), ROWS_PER_STATEMENT):
                chunk = wanted[start : start + ROWS_PER_STATEMENT]
                query = sa.select(settlements.c.seq, settlements.c.records).where(
                    settlements.c.seq.in_(chunk)
                )
                for seq, text in _tuples(await self._db.fetch_all(query)):
                    out[int(seq)] = decode_journal(text)
        return out

    async def prune_journal(self, before_us: int) -> None:
        """Drop the journal rows of settlements older than ``before_us``."""
        async with self._guard("journal prune"):
            await self._db.execute(settlements.delete().where(settlements.c.settled_us < before_us))
