"""The alerts outbox on SQLite and PostgreSQL: one row per alert id whoever adds it, and a
claim only one sender wins."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import anyio
import pytest

from spendguard.alerts import parse_pending
from spendguard.alerts.events import Alert
from spendguard.ledger import Ledger

pytestmark = pytest.mark.anyio

T = datetime(2026, 9, 30, 12, 0, tzinfo=UTC)


def alert(percent: int, key: str = "alpha") -> Alert:
    found = parse_pending("acme", f"api_key:{key}:day:20260930 {percent} 1000", "990 1790000000000")
    assert found is not None
    return found


async def test_an_alert_added_twice_is_kept_once(ledger: Ledger) -> None:
    assert await ledger.add_alerts([alert(50), alert(80)]) == [alert(50), alert(80)]
    assert await ledger.add_alerts([alert(80), alert(100)]) == [alert(100)]
    assert sorted(a.percent for a, _, _ in await ledger.recent_alerts()) == [50, 80, 100]


async def test_one_claim_wins_and_a_delivered_alert_is_never_claimed_again(ledger: Ledger) -> None:
    await ledger.add_alerts([alert(50, key) for key in ("a", "b", "c", "d")])
    won: list[list[Alert]] = []

    async def claim() -> None:
        won.append(await ledger.claim_alerts(T, until=T + timedelta(seconds=30), limit=10))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(claim)
    ids = [a.id for claimed in won for a in claimed]
    assert sorted(ids) == sorted(alert(50, key).id for key in "abcd")  # each claimed once
    # Claimed: nobody else gets them until the claim ends.
    assert await ledger.claim_alerts(T + timedelta(seconds=29), until=T, limit=10) == []
    first = ids[0]
    await ledger.alert_delivered(first, T)
    await ledger.alert_failed(ids[1], T + timedelta(seconds=60), "HTTP 503")
    later = await ledger.claim_alerts(
        T + timedelta(seconds=31), until=T + timedelta(seconds=100), limit=10
    )
    assert sorted(a.id for a in later) == sorted(ids[2:])  # the failed one waits for its time
    again = await ledger.claim_alerts(T + timedelta(seconds=61), until=T, limit=10)
    assert [a.id for a in again] == [ids[1]]
    assert await ledger.alert_attempts(ids[1]) == 2
    delivered = {a.id: done for a, done, _ in await ledger.recent_alerts()}
    assert delivered[first] == T and delivered[ids[1]] is None
