"""Finishing writes to the slot every gateway shares, carried together by one finishing round
in several (design.md, "Carried writes").

On a Redis Cluster every finishing round wrote to two nodes: the team's (the spend limits'
postflight, the key's budget) and the shared slot's (the model's and the fleet's budget
commits of a stocked hold, the provider lease's settlement). The second costs the gateway a
``send``, a read and a wake-up per request. So those writes wait here, and a finishing round
carries them once :data:`RIDE_AT` are waiting, all in its pipeline write: most finishing rounds
write to the team's node alone, and no round is added. The carrying request awaits their
replies with its own, after its response is out.

What waiting changes, and why it is safe:

- The buckets and the provider key count a finished request's *hold* (its estimate, the
  stock's size) until its writes land, instead of its actual use. Stocked holds only exist far
  from a limit (engine/stock.py), and a commit never depends on when it lands: it names its
  hold and the slice of the request's start.
- Crash safety is the admission entries': the records writer removes an entry only once the
  writes carried for it have landed (:meth:`Carryover.settle` first), so a gateway killed with
  writes waiting leaves their entries, and recovery commits those holds (once: a commit of a
  hold already gone counts nothing).
- With fewer finishing rounds to carry them, they leave with the records writer's next batch,
  or at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Final

log = logging.getLogger("spendguard")

# Sends the items of one group as one write (one script call for every hold of a bucket),
# before it returns (so that the write joins the round carrying it); what it returns awaits
# the reply.
SendAll = Callable[[list[Any]], Awaitable[object]]

# A finishing round carries the waiting writes once this many requests' wait: one shared-slot
# write per this many requests, each counted at its hold there for at most this many finishes.
RIDE_AT: Final = 8


class Carryover:
    """One gateway's waiting shared-slot writes, in groups: each group's are sent as one
    call, by a function that returns what awaits its reply (and never raises)."""

    __slots__ = ("_groups", "_ids", "_landing", "_requests", "sent_alone")

    def __init__(self) -> None:
        # Writes sent together, one call per group: group -> (how, items, their record ids).
        self._groups: dict[Hashable, tuple[SendAll, list[Any], list[str]]] = {}
        self._requests = 0  # admissions with writes queued
        # Record ids with writes queued or in flight: their admission entries stay meanwhile.
        self._ids: dict[str, int] = {}
        # Set when a sent batch has landed (or failed).
        self._landing: set[asyncio.Future[None]] = set()
        # Batches sent by settle, in a round of their own (off the request path).
        self.sent_alone = 0

    def add_to(self, group: Hashable, item: Any, send_all: SendAll, record_id: str) -> None:
        """Carry ``item`` (for the admission ``record_id``) in ``group``: the items of a group
        leave together, as ``send_all(items)`` (the first item's ``send_all``)."""
        found = self._groups.get(group)
        if found is None:
            self._groups[group] = (send_all, [item], [record_id])
        else:
            found[1].append(item)
            found[2].append(record_id)
        known = self._ids.get(record_id, 0)
        if not known:
            self._requests += 1
        self._ids[record_id] = known + 1

    def rider(self) -> Awaitable[None] | None:
        """Once enough wait: send them now, so that on Redis they leave in the caller's
        pipeline write, and return what awaits their replies (it must be awaited). None
        while fewer wait."""
        if self._requests < RIDE_AT:
            return None
        return self._send()

    def _send(self) -> Awaitable[None]:
        groups, self._groups = self._groups, {}
        self._requests = 0
        sent: list[Awaitable[object]] = []
        ids: list[str] = []
        for send_all, items, group_ids in groups.values():
            ids += group_ids
            try:
                sent.append(send_all(items))
            except Exception as exc:  # a bug in one group must not lose the others
                log.warning("spendguard could not send carried writes: %r", exc)
        landed = asyncio.get_running_loop().create_future()
        self._landing.add(landed)
        return self._land(sent, ids, landed)

    async def _land(
        self, sent: list[Awaitable[object]], ids: list[str], landed: asyncio.Future[None]
    ) -> None:
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
            self._landing.discard(landed)
            if not landed.done():
                landed.set_result(None)

    def waiting(self, record_ids: Iterable[str]) -> bool:
        """Whether any of these admissions has a write queued or in flight."""
        ids = self._ids
        return bool(ids) and any(i in ids for i in record_ids)

    def __len__(self) -> int:
        """Writes queued (not yet sent): one per group."""
        return len(self._groups)

    async def settle(self) -> None:
        """Send what waits, and wait until everything sent by now has landed (or failed)."""
        loop = asyncio.get_running_loop()
        # (A batch sent in an event loop that has ended since never lands: not waited for.)
        landing = [f for f in self._landing if f.get_loop() is loop]
        if self._groups:
            self.sent_alone += 1
            await self._send()
        if landing:
            await asyncio.gather(*landing)
