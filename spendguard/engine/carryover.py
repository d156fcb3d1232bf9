"""Finishing writes to the slot every gateway shares, carried by this gateway's next admission
round instead of its finishing one (design.md, "Carried writes").

On a Redis Cluster the finishing round wrote to two nodes: the team's (the spend limits'
postflight, the key's budget) and the shared slot's (the model's and the fleet's budget
commits of a stocked hold, the provider lease's settlement). The shared slot's node is written
by the admission round anyway (the lease, the stock's refills), so its finishing writes wait
here and leave, ahead of the next admission's own calls, in that round's pipeline write: the
finishing round writes to the team's node alone, and no round is added.

What waiting changes, and why it is safe:

- The buckets and the provider key count a finished request's *hold* (its estimate, the
  stock's size) until its writes land, instead of its actual use. Stocked holds only exist far
  from a limit (engine/stock.py), and a commit never depends on when it lands: it names its
  hold and the slice of the request's start. This gateway's next admission sees them landed
  (they run first on the node); other gateways see them a round later.
- Crash safety is the admission entries': the records writer closes an entry only once the
  writes carried for it have landed (:meth:`Carryover.settle` before it closes them), so a
  gateway killed with writes waiting leaves their entries, and recovery commits those holds
  (once: a commit of a hold already gone counts nothing).
- With no further admission, they leave with the records writer's next batch, a few tens of
  milliseconds later, or at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

log = logging.getLogger("spendguard")

Send = Callable[[], Awaitable[object]]


class Carryover:
    """One gateway's waiting shared-slot writes: each sends its store calls when called and
    returns what awaits their replies (and never raises)."""

    __slots__ = ("_ids", "_landing", "_queued")

    def __init__(self) -> None:
        self._queued: list[tuple[Send, str]] = []
        # Record ids with writes queued or in flight: their admission entries stay meanwhile.
        self._ids: dict[str, int] = {}
        self._landing: set[asyncio.Task[None]] = set()

    def add(self, send: Send, record_id: str) -> None:
        """Carry ``send`` (a write for the admission ``record_id``) to the next round."""
        self._queued.append((send, record_id))
        self._ids[record_id] = self._ids.get(record_id, 0) + 1

    def ride(self) -> None:
        """Send what waits, now: called by an admission round before it sends its own calls,
        so that on Redis they leave in its pipeline write, and run first on their node."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        sent: list[Awaitable[object]] = []
        for send, _ in queued:
            try:
                sent.append(send())
            except Exception as exc:  # a bug in one write must not lose the others
                log.warning("spendguard could not send a carried write: %r", exc)
        task = asyncio.get_running_loop().create_task(self._land(sent, [i for _, i in queued]))
        self._landing.add(task)
        task.add_done_callback(self._landing.discard)

    async def _land(self, sent: list[Awaitable[object]], ids: list[str]) -> None:
        try:
            for done in sent:
                try:
                    await done
                except Exception as exc:  # each write logs its own; this is a last resort
                    log.warning("spendguard carried write failed: %r", exc)
        finally:
            for record_id in ids:
                left = self._ids.get(record_id, 0) - 1
                if left > 0:
                    self._ids[record_id] = left
                else:
                    self._ids.pop(record_id, None)

    def waiting(self, record_ids: Iterable[str]) -> bool:
        """Whether any of these admissions has a write queued or in flight."""
        ids = self._ids
        return bool(ids) and any(i in ids for i in record_ids)

    def __len__(self) -> int:
        """Writes queued (not yet sent)."""
        return len(self._queued)

    async def settle(self) -> None:
        """Send what waits and wait until everything sent by now has landed (or failed)."""
        self.ride()
        if self._landing:
            await asyncio.gather(*list(self._landing), return_exceptions=True)
