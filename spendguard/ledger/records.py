"""Inference records: written once by the recorder, read back by the worker and the CLI.

A record is what one inference cost by its estimate; settlement (see
:mod:`spendguard.ledger.settlement`) prices it, charges it once and marks it settled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ..clock import from_micros, to_micros, utcnow
from ..record import InferenceRecord, PostflightStatus
from .database import ROWS_PER_STATEMENT, LedgerDatabase, _text, _tuples
from .schema import charges, records
from .settlement import SettledRecord


class RecordQueries(LedgerDatabase):
    async def insert_records(self, batch: Sequence[InferenceRecord]) -> None:
        """Write records idempotently: a record re-sent after an unknown outcome is kept once."""
        if not batch:
            return
        now_us = to_micros(utcnow())
        rows = [_record_values(r, now_us) for r in batch]
        async with self._guard("record write"), self._db.transaction():
            for start in range(0, len(rows), ROWS_PER_STATEMENT):
                chunk = rows[start : start + ROWS_PER_STATEMENT]
                stmt = (
                    self._insert(records)
                    .values(chunk)
                    .on_conflict_do_nothing(index_elements=[records.c.id])
                )
                await self._db.execute(stmt)

    async def unsettled(self, team: str | None = None) -> tuple[int, int]:
        """(count, sum of estimates in micro-USD) of the records not settled yet."""
        query = sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.sum(records.c.estimate_micros), 0)
        ).where(records.c.settled == sa.false())
        if team is not None:
            query = query.where(records.c.team == team)
        async with self._guard("record read"):
            row = await self._db.fetch_one(query)
        assert row is not None  # an aggregate query always returns one row
        return int(row[0]), int(row[1])

    async def settled_records(self, record_ids: Sequence[str]) -> dict[str, SettledRecord]:
        """Which of these records are settled (by any worker, at any time), and where they
        count. The worker asks this of estimates its cache still holds."""
        out: dict[str, SettledRecord] = {}
        ids = list(dict.fromkeys(record_ids))
        async with self._guard("charge read"):
            for start in range(0, len(ids), ROWS_PER_STATEMENT):
                query = (
                    sa.select(
                        charges.c.record_id,
                        charges.c.team,
                        charges.c.api_key,
                        records.c.t0_us,
                        records.c.postflight,
                    )
                    .select_from(charges.join(records, records.c.id == charges.c.record_id))
                    .where(charges.c.record_id.in_(ids[start : start + ROWS_PER_STATEMENT]))
                )
                for rid, team, key, t0_us, status in _tuples(await self._db.fetch_all(query)):
                    out[rid] = SettledRecord(
                        id=rid,
                        team=team,
                        api_key=key or None,
                        t0=from_micros(int(t0_us)),
                        unknown=status == PostflightStatus.UNKNOWN,
                    )
        return out


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
