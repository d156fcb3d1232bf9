"""What a budget store keeps and answers: buckets of time-sliced windows plus expiring holds.

A *bucket* is one scope's subject (a key, a model, the fleet). For each window it keeps the
committed usage in :data:`~spendguard.budgets.config.SLICES` slices of ``period / SLICES``;
a slice leaves the window as a whole when the window has moved past it, so usage drains slice by
slice and a 24h window always holds (about) the last 24 hours. In flight requests are *holds*:
an admission estimate reserved in the bucket (counted in every window) until the response ends
and the hold is replaced by the actual usage, or returned. A hold also expires by itself after
``hold_seconds``, so a gateway that dies mid-request cannot keep budget reserved.

Each call on one bucket is atomic (one Lua script on Redis). A request touches up to three
buckets, each its own call: the engine compensates when one of them denies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..limits.model import Unit
from ..limits.windows import SLICES, Rolling
from .config import BudgetLimit, Scope


@dataclass(frozen=True, slots=True)
class Bucket:
    """One scope's subject. ``subject`` is encoded (key-safe): ``team:key``, a model, or ''."""

    scope: Scope
    subject: str

    @property
    def tag(self) -> str:
        """The Redis Cluster hash tag: all of one bucket's keys share a slot, no more."""
        return {Scope.PER_API_KEY: "bk", Scope.PER_MODEL: "bm", Scope.GLOBAL: "bg"}[self.scope] + (
            f":{self.subject}" if self.subject else ""
        )


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class WindowCheck:
    window: Rolling
    limit: BudgetLimit


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class BucketCheck:
    """One bucket and the limits that apply to it, window by window (in config order)."""

    bucket: Bucket
    checks: tuple[WindowCheck, ...]

    @property
    def windows(self) -> tuple[Rolling, ...]:
        return tuple(c.window for c in self.checks)


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Hold:
    """What one admission reserves: ``tokens`` and ``cost`` (micro-USD) until ``expires_ms``.
    ``count_cost`` is False for a model without a price: cost limits don't apply to it."""

    id: str
    now_ms: int
    expires_ms: int
    tokens: int
    cost: int
    count_cost: bool
    ttl_ms: int  # how long the bucket's keys live: the longest window plus the hold time


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Reserved:
    """A bucket's answer. Admitted: ``used_tokens`` per window, this hold included. Denied: the
    first window (index) and unit that can't afford it, and when enough will have drained."""

    ok: bool
    used_tokens: tuple[int, ...] = ()
    window: int = -1
    unit: Unit = Unit.TOKENS
    retry_ms: int = 0
    unseeded: bool = False  # Redis lost the bucket: rebuild it from the ledger, then retry


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class WindowUsage:
    window: Rolling
    tokens: int  # committed in the window
    cost: int


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class BucketUsage:
    bucket: Bucket
    held_tokens: int  # live holds (in every window)
    held_cost: int
    windows: tuple[WindowUsage, ...]


class BudgetStore(Protocol):
    shared: bool  # True: every replica sees the same counters (Redis)

    # The request path's calls are sent before they return (on Redis: into the spend store's
    # next pipeline write, so budgets and spend limits cost one round trip together); the
    # awaitable they return has the answer, and must be awaited.
    def reserve(self, calls: Sequence[BucketCheck], hold: Hold) -> Awaitable[list[Reserved]]:
        """Reserve ``hold`` in each bucket where every window can afford it (each bucket on
        its own, atomically); one answer per call, in order."""
        ...

    def commit(
        self,
        calls: Sequence[BucketCheck],
        hold_id: str,
        *,
        now_ms: int,
        at_ms: int,
        tokens: int,
        cost: int,
        ttl_ms: int,
    ) -> Awaitable[object]:
        """Replace the hold by the actual usage, counted in the slice of ``at_ms``."""
        ...

    def release(self, buckets: Sequence[Bucket], hold_id: str) -> Awaitable[object]:
        """Return the hold (nothing is counted)."""
        ...

    async def inspect(self, call: BucketCheck, now_ms: int) -> BucketUsage: ...

    async def reset(self, bucket: Bucket, windows: Sequence[Rolling]) -> None:
        """Forget the committed usage of ``windows`` (holds stay: their requests still end)."""
        ...

    async def seed(
        self, call: BucketCheck, slices: Sequence[Sequence[tuple[int, int, int]]], ttl_ms: int
    ) -> bool:
        """Fill a bucket the store lost with rebuilt usage: per window, (slice index, tokens,
        cost) triples. False when another process seeded it first (nothing written)."""
        ...

    async def buckets(self) -> list[Bucket]:
        """Every bucket the store has counters for."""
        ...

    async def aclose(self) -> None: ...


def retry_ms(
    slices: dict[int, int],
    window: Rolling,
    now_ms: int,
    used: int,
    wanted: int,
    limit: int,
) -> int:
    """Milliseconds until enough of the window's slices (index -> amount) have left it for
    ``wanted`` to fit under ``limit``. Mirrors reserve.lua.

    A request larger than the limit itself never fits: the whole period is answered. When the
    committed slices are not enough (live holds of requests in flight fill the rest) it is the
    time until all of them have left, or a second when there are none: holds end with their
    requests, typically within seconds, and nothing says when.
    """
    slice_ms = window.slice_ms
    if wanted > limit:
        return window.period_ms
    need = used + wanted - limit
    cur = now_ms // slice_ms
    drained = 0
    last = 0
    for idx in range(cur - SLICES + 1, cur + 1):
        amount = slices.get(idx, 0)
        if amount <= 0:
            continue
        drained += amount
        last = (idx + SLICES) * slice_ms - now_ms
        if drained >= need:
            return max(last, 1)
    return max(last, 1000)
