"""Recent denials: who was refused, by what, and when, kept for the reports a person reads
(the top spenders, the spend page), never for enforcement.

A refused round notes its denial here (an append to a bounded queue: nothing more on the
request path); a background pass writes the queue into the ledger in one batch and forgets
denials older than :data:`KEEP`. A queue that fills between passes drops the oldest (counted
in the log line of the next pass): these are for reading, not accounting. Outages (a store or
ledger that did not answer) are not denials.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus

from ..clock import utcnow
from ..errors import LedgerUnavailable
from ..identity import Identity
from ..limits import Balance, Limit
from .decision import Admission, Verdict

if TYPE_CHECKING:
    from ..ledger import Ledger

log = logging.getLogger("spendguard")

KEEP = timedelta(days=7)
_CAPACITY = 10_000


@dataclass(frozen=True, slots=True)
class Denial:
    identity: Identity
    kind: str  # api_key:day, team:month, balance, rate, model, unpriced, budget, capacity, ...
    model: str
    at: datetime


def spend_denial_kind(admission: Admission) -> str | None:
    """What the spend limits' refusal was (None: an outage, not a denial)."""
    verdict = admission.verdict
    if verdict is Verdict.DENY:
        decision = admission.decision
        target = (
            None if decision is None or decision.denied is None else decision.denied.check.target
        )
        if isinstance(target, Limit):
            return f"{target.subject.kind.value}:{target.window.value}"
        if isinstance(target, Balance):
            return "balance"
        return "limit"
    if verdict in (Verdict.RATE_LIMITED, Verdict.MODEL_NOT_ALLOWED, Verdict.UNPRICED):
        return {Verdict.RATE_LIMITED: "rate", Verdict.MODEL_NOT_ALLOWED: "model"}.get(
            verdict, "unpriced"
        )
    return None


class DenialLog:
    def __init__(self, ledger: Ledger, clock: Callable[[], datetime] = utcnow) -> None:
        self._ledger = ledger
        self._clock = clock
        self._queue: deque[Denial] = deque(maxlen=_CAPACITY)
        self._dropped = 0
        self._pruned_at: datetime | None = None

    def note(self, identity: Identity, kind: str, model: str) -> None:
        if len(self._queue) == _CAPACITY:
            self._dropped += 1
        self._queue.append(Denial(identity, kind, model, self._clock()))

    async def flush(self) -> int:
        """Write what was noted; returns how many. The ledger down: kept for the next pass."""
        batch = list(self._queue)
        if batch:
            try:
                await self._ledger.add_denials(batch)
            except LedgerUnavailable as exc:
                log.warning("spendguard denials wait for the ledger: %r", exc)
                return 0
            for _ in batch:
                self._queue.popleft()
        if self._dropped:
            log.warning("spendguard dropped %d denials (the queue was full)", self._dropped)
            self._dropped = 0
        now = self._clock()
        if self._pruned_at is None or now - self._pruned_at > timedelta(hours=1):
            self._pruned_at = now
            await self._ledger.forget_denials(before=now - KEEP)
        return len(batch)

    async def run(self, interval: float, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            await anyio.sleep(interval)
            try:
                await self.flush()
            except Exception:  # a pass must never end the loop
                log.exception("spendguard denial pass failed")
