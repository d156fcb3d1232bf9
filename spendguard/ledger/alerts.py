"""The alerts outbox: alerts the store fired, kept until a webhook receiver took them.

Adding is idempotent by the alert's id (one threshold of one limit amount in one window), so
two gateways moving the same alert, or one moving it twice, leave one row. Delivery claims a
row for a while before sending (a conditional update only one gateway wins), so replicas
sending side by side never send one alert twice at once; a gateway dying mid-send leaves its
claim to expire, and the alert is sent again with the same id (at least once).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa

from ..alerts.events import Alert
from ..clock import from_micros, to_micros
from .database import LedgerDatabase
from .schema import alerts as table


class AlertQueries(LedgerDatabase):
    async def add_alerts(self, fired: Sequence[Alert]) -> list[Alert]:
        """Keep ``fired`` in the outbox; returns those that were not there yet."""
        added: list[Alert] = []
        async with self._guard("alert write"):
            for alert in fired:
                stmt = (
                    self._insert(table)
                    .values(_row(alert))
                    .on_conflict_do_nothing(index_elements=["id"])
                    .returning(table.c.id)
                )
                if await self._db.fetch_all(stmt):
                    added.append(alert)
        return added

    async def claim_alerts(self, now: datetime, *, until: datetime, limit: int) -> list[Alert]:
        """Undelivered alerts due at ``now`` and claimed by nobody, now claimed by the caller
        until ``until`` (oldest first)."""
        now_us = to_micros(now)
        due = (
            table.c.delivered_us.is_(None),
            table.c.next_us <= now_us,
            table.c.claimed_us <= now_us,
        )
        claimed: list[Alert] = []
        async with self._guard("alert claim"):
            rows = await self._db.fetch_all(
                sa.select(table.c.id).where(*due).order_by(table.c.fired_us).limit(limit)
            )
            for row in rows:
                won = await self._db.fetch_all(
                    table.update()
                    .where(table.c.id == row[0], *due)
                    .values(claimed_us=to_micros(until), attempts=table.c.attempts + 1)
                    .returning(*table.c)
                )
                claimed += [_alert(r._mapping) for r in won]
        return claimed

    async def alert_delivered(self, alert_id: str, at: datetime) -> None:
        async with self._guard("alert delivered"):
            await self._db.execute(
                table.update()
                .where(table.c.id == alert_id)
                .values(delivered_us=to_micros(at), claimed_us=0, last_error=None)
            )

    async def alert_failed(self, alert_id: str, retry_at: datetime, error: str) -> None:
        async with self._guard("alert failed"):
            await self._db.execute(
                table.update()
                .where(table.c.id == alert_id)
                .values(next_us=to_micros(retry_at), claimed_us=0, last_error=error[:500])
            )

    async def alert_attempts(self, alert_id: str) -> int:
        async with self._guard("alert read"):
            found = await self._db.fetch_val(
                sa.select(table.c.attempts).where(table.c.id == alert_id)
            )
        return int(found or 0)

    async def recent_alerts(self, limit: int = 50) -> list[tuple[Alert, datetime | None, int]]:
        """The newest alerts: each with when it was delivered (None: not yet) and its
        delivery attempts."""
        async with self._guard("alert list"):
            rows = await self._db.fetch_all(
                sa.select(table)
                .order_by(table.c.fired_us.desc(), table.c.percent.desc(), table.c.id)
                .limit(limit)
            )
        out: list[tuple[Alert, datetime | None, int]] = []
        for r in rows:
            m = r._mapping
            done = m["delivered_us"]
            out.append((_alert(m), None if done is None else from_micros(int(done)), m["attempts"]))
        return out


def _row(alert: Alert) -> dict[str, object]:
    return {
        "id": alert.id,
        "kind": alert.kind,
        "team": alert.team,
        "api_key": alert.api_key or "",
        "period": alert.window,
        "bucket": alert.bucket,
        "scope": alert.scope,
        "unit": alert.unit,
        "model": alert.model,
        "percent": alert.percent,
        "limit_micros": alert.limit_micros,
        "used_micros": alert.used_micros,
        "fired_us": to_micros(alert.fired_at),
        "runs_out_us": None if alert.runs_out_at is None else to_micros(alert.runs_out_at),
        "attempts": 0,
        "next_us": 0,
        "claimed_us": 0,
    }


def _alert(m: object) -> Alert:
    row: dict[str, object] = dict(m)  # type: ignore[call-overload]
    return Alert(
        str(row["id"]),
        str(row["team"]),
        str(row["api_key"]) or None,
        str(row["period"]),
        str(row["bucket"]),
        int(row["percent"]),  # type: ignore[call-overload]
        int(row["limit_micros"]),  # type: ignore[call-overload]
        int(row["used_micros"]),  # type: ignore[call-overload]
        from_micros(int(row["fired_us"])),  # type: ignore[call-overload]
        str(row["kind"]),
        None if row["runs_out_us"] is None else from_micros(int(row["runs_out_us"])),  # type: ignore[call-overload]
        scope=str(row["scope"]),
        unit=str(row["unit"]),
        model=None if row["model"] is None else str(row["model"]),
    )
