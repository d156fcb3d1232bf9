"""What the ledger tests share: two instants either side of a month end, subjects, policies.

Plain helpers for the tests of this package: no fixtures and no tests.
"""

from __future__ import annotations

from datetime import UTC, datetime

from spendguard.identity import Identity
from spendguard.ledger import Ledger
from spendguard.limits import Period, Policy, Subject, limit_for

SEP30_LATE = datetime(2026, 9, 30, 23, 59, 59, 999000, tzinfo=UTC)
OCT1 = datetime(2026, 10, 1, 0, 0, 5, tzinfo=UTC)

ACME = Subject("acme")
ALPHA = Subject("acme", "alpha")


def policy(period: Period, amount: int, key: str | None = "alpha", team: str = "acme") -> Policy:
    ident = Identity(team, key)
    return Policy(limit_for(ident, period), amount, team_id=team, api_key_id=key)


async def set_policy(
    led: Ledger, period: Period, amount: int, key: str | None = "alpha", now: datetime = SEP30_LATE
) -> Policy:
    return await led.set_policy(policy(period, amount, key), now=now)
