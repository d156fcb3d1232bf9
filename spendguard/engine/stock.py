"""Stocked holds: a gateway's holds in the shared budget buckets, reserved ahead of its
requests, so that a warm request sends no script to those buckets' slots on its way in.

The model's and the fleet's buckets are shared by every key and every gateway: without stock,
each request reserves in each of them, a script apiece in the admission round. With stock, a
gateway keeps holds there (8, more while its requests come faster than refills land: see
:data:`START`) under record ids drawn ahead (``bucket_stock.lua``), and a
request that fits one takes its id as its own record id: its admission entry, its commit, its
release and a dead gateway's recovery then name that hold exactly as they name a hold reserved
for it, so nothing about recovery changes. Its own buckets (the key's, its end user's, its
tags', its customer's) are still reserved in the round.

What it costs, and why it holds (design.md, "Stocked holds"):

- A bucket grants stock only while what stays free is at least ``share`` times the stock, so
  near a limit there is none and every request is decided centrally, as without it.
- A central refusal in a bucket this gateway held unused stock of when the request's round was
  sent waits for a refill on its way, gives the stock back, stops refills there for a while
  and asks once more: the stock never refuses what the limit would admit, beyond what
  requests in flight on stocked holds hold over their own estimates (each stocked hold has the
  size of the request that asked for the refill; only a request no larger takes one) and what
  other gateways hold unused.
- Holds are a little older than the requests that take them: an id is taken only while it is
  fresh (a tenth of the hold time, at most 30 s), and a stale one goes back with the next
  refill. Unused stock goes back when the gateway stops; a killed gateway's lapses with the
  holds' expiry.
- Refills ride the round of the request that found the shelf low: sent with its own calls, in
  the same pipeline write, and awaited with them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from ..store import Store
from ..store.rolling import BucketCheck, Hold

log = logging.getLogger("spendguard.budgets")

# A stocked id is taken while it is younger than this share of the hold time (and 30 s), so a
# request's hold outlives it by nearly as long as a hold reserved for it would.
FRESH_SHARE = 10
FRESH_MAX_MS = 30_000
# A shelf starts at this many holds (the gateway's most, when lower). A refill after requests
# found it empty doubles it, up to the most; one after none did takes a quarter off, down to
# this again. A request at a time is served by a few; 64 at once by as many, since a round's
# requests all come for theirs before its refill lands (a shelf of 8 ran dry in every burst,
# and most of its requests reserved centrally).
START = 8
# A refill not landed after this long is taken for lost (its coroutine never ran: the request
# that carried it was cancelled first); what it held lapses with the holds' expiry.
LOST_REFILL_S = 5.0


@dataclass(slots=True)
class Shelf:
    """One gateway's stocked holds in one group of shared buckets (a model's and the fleet's,
    under one section): ids held in every bucket of the group, each of one size."""

    calls: tuple[BucketCheck, ...]
    section: object  # the budgets section they were stocked under
    # (id, granted at ms, tokens, cost): the oldest first.
    ids: deque[tuple[str, int, int, int]] = field(default_factory=deque)
    # A refill on its way: set when it lands (None: none is).
    asking: anyio.Event | None = None
    asked_ms: int = 0
    # No refill before this (ms): a request was refused in one of these buckets, so they are
    # near a limit, where every request is decided centrally.
    dry_until_ms: int = 0
    # How many ids a refill fills the shelf up to, and the requests that found none since the
    # last refill was sent: the next refill's size (see START).
    target: int = START
    missed: int = 0

    def holding(self) -> bool:
        """Whether this gateway holds, or is being granted, unused stock here."""
        return bool(self.ids) or self.asking is not None


class Stock:
    """The shelves of one budget gate. ``size``: the most ids a shelf holds (0: off);
    ``share``: how many times the stock a bucket keeps free for everyone else when it grants
    some."""

    __slots__ = ("_orphans", "_shelves", "share", "size", "taken")

    def __init__(self, size: int, share: int) -> None:
        self.size, self.share = size, share
        self.taken = 0  # requests admitted on a stocked hold, so far
        self._shelves: dict[str, Shelf] = {}
        # Shelves of a section no longer in force: their ids go back with the next refill.
        self._orphans: list[Shelf] = []

    def shelf(self, section: object, model: str, calls: tuple[BucketCheck, ...]) -> Shelf:
        """The shelf of ``model``'s shared buckets (``calls``) under ``section``."""
        found = self._shelves.get(model)
        if found is None or found.section is not section:
            if found is not None and found.ids:
                self._orphans.append(found)
            found = self._shelves[model] = Shelf(calls, section, target=self._least)
        return found

    @property
    def _least(self) -> int:
        return min(START, self.size)

    def take(self, shelf: Shelf, hold: Hold, fresh_ms: int) -> str | None:
        """A fresh stocked id that ``hold`` fits in, taken off the shelf (None: none). Stale
        ids stay for the next refill to return."""
        for i, (stock_id, granted, tokens, cost) in enumerate(shelf.ids):
            if hold.now_ms - granted >= fresh_ms:
                continue
            if hold.tokens <= tokens and (not hold.count_cost or hold.cost <= cost):
                del shelf.ids[i]
                self.taken += 1
                return stock_id
        shelf.missed += 1
        return None

    def refill(
        self,
        shelf: Shelf,
        store: Store,
        hold: Hold,
        draw: Callable[[], str],
        fresh_ms: int,
        require_seed: bool,
    ) -> Awaitable[None] | None:
        """Send a refill of ``shelf`` now when it runs low (None: not due): ids drawn ahead
        (``draw``), each as large as ``hold`` (a larger request reserves centrally; a
        smaller one holds a little more than it needs until it ends), the stale ids given
        back in the same write. The result, awaited, puts on the shelf the ids every bucket
        of the group granted and gives back those only some did."""
        ids = shelf.ids
        if hold.now_ms < shelf.dry_until_ms:
            return None
        if shelf.asking is not None:
            if hold.now_ms - shelf.asked_ms < LOST_REFILL_S * 1000:
                return None
            _landed(shelf)
        half = shelf.target // 2
        if len(ids) > half and hold.now_ms - ids[0][1] < fresh_ms:
            return None  # the oldest is fresh (the shelf is in the order of the grants)
        stale = [entry[0] for entry in ids if hold.now_ms - entry[1] >= fresh_ms]
        if len(shelf.ids) - len(stale) > half:
            return None
        target = shelf.target
        if shelf.missed:
            target = min(self.size, 2 * target)
        else:
            target = max(self._least, target - target // 4)
        shelf.target, shelf.missed = target, 0
        if stale:
            old_ids = set(stale)
            shelf.ids = deque(entry for entry in shelf.ids if entry[0] not in old_ids)
        size = Hold(
            id="",
            now_ms=hold.now_ms,
            expires_ms=hold.expires_ms,
            tokens=hold.tokens,
            cost=hold.cost,
            count_cost=hold.count_cost,
            ttl_ms=hold.ttl_ms,
        )
        wanted = [draw() for _ in range(max(0, target - len(shelf.ids)))]
        shelf.asking, shelf.asked_ms = anyio.Event(), hold.now_ms
        try:
            returning = [store.release_stock(c.bucket, stale) for c in shelf.calls if stale]
            orphans, self._orphans = self._orphans, []
            for orphan in orphans:
                gone = [entry[0] for entry in orphan.ids]
                returning += [store.release_stock(c.bucket, gone) for c in orphan.calls]
            granting = [
                store.stock_bucket(c, size, wanted, self.share, require_seed=require_seed)
                for c in shelf.calls
            ]
        except Exception:
            _landed(shelf)
            raise
        return self._stocked(shelf, store, size, wanted, granting, returning)

    async def _stocked(
        self,
        shelf: Shelf,
        store: Store,
        size: Hold,
        wanted: list[str],
        granting: list[Awaitable[int]],
        returning: list[Awaitable[int]],
    ) -> None:
        granted: list[int] = []
        try:
            for answer in granting:
                try:
                    granted.append(max(0, await answer))
                except Exception as exc:  # what it held lapses with the holds' expiry
                    log.debug("budget stock not granted: %r", exc)
                    granted.append(0)
            for done in returning:
                try:
                    await done
                except Exception as exc:  # they lapse with the holds' expiry
                    log.debug("stale budget stock not returned: %r", exc)
            every = min(granted, default=0)
            extra = [
                store.release_stock(c.bucket, wanted[every:n])
                for c, n in zip(shelf.calls, granted, strict=True)
                if n > every
            ]
            for done in extra:
                try:
                    await done
                except Exception as exc:
                    log.debug("budget stock not returned: %r", exc)
            shelf.ids.extend((i, size.now_ms, size.tokens, size.cost) for i in wanted[:every])
        finally:
            _landed(shelf)

    async def give_back(
        self, shelf: Shelf, store: Store, *, dry_until_ms: int = 0, held: bool = False
    ) -> bool:
        """Return every unused id of ``shelf``, once the refill on its way (if any) has landed,
        and send no refill before ``dry_until_ms``. True when the stock may have stood in the
        way of a request refused there: ``held`` (it held some when that request's round was
        sent, since given back by another or taken), a refill landed meanwhile, or ids went
        back now; the request then asks once more."""
        shelf.dry_until_ms = max(shelf.dry_until_ms, dry_until_ms)
        landing = shelf.asking
        if landing is not None:
            with anyio.move_on_after(LOST_REFILL_S):
                await landing.wait()
            if shelf.asking is landing:
                _landed(shelf)  # lost; its holds lapse with their expiry
            held = True
        if not shelf.ids:
            return held
        ids = [entry[0] for entry in shelf.ids]
        shelf.ids.clear()
        await _quietly([store.release_stock(c.bucket, ids) for c in shelf.calls])
        return True

    async def give_all_back(self, store: Store) -> None:
        """Return every unused id (the gateway stops)."""
        shelves, self._shelves = list(self._shelves.values()), {}
        shelves += self._orphans
        self._orphans = []
        for shelf in shelves:
            await self.give_back(shelf, store)

    def forget(self) -> None:
        """Drop every shelf without a word to the store (it is down: the holds lapse)."""
        self._shelves.clear()
        self._orphans.clear()


def _landed(shelf: Shelf) -> None:
    landing, shelf.asking = shelf.asking, None
    if landing is not None:
        landing.set()


def fresh_ms(hold_ms: int) -> int:
    return min(hold_ms // FRESH_SHARE, FRESH_MAX_MS)


async def _quietly(calls: list[Awaitable[int]]) -> None:
    for call in calls:
        try:
            await call
        except Exception as exc:  # they lapse with the holds' expiry
            log.debug("budget stock not returned: %r", exc)
