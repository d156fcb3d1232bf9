"""The in-process budget store: per replica (N replicas enforce up to N times a limit), bounded.

The same rules as the Lua scripts, in Python. Every method runs without awaiting, so each call
is atomic on the event loop. It also serves as the bounded fail-open tracker while Redis is
unreachable (``max_buckets``: past it a new bucket is refused, never counted loosely).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

from ..errors import StoreFull
from ..limits.model import Unit
from ..limits.windows import SLICES, Rolling
from .store import (
    Bucket,
    BucketCheck,
    BucketUsage,
    Hold,
    Reserved,
    WindowUsage,
    retry_ms,
)


def _window_key(window: Rolling) -> tuple[str, int]:
    # A window whose period changes (a reload) starts a new series: old slices meant other times.
    return (window.id, window.seconds)


@dataclass(slots=True)
class _Slices:
    tokens: dict[int, int] = field(default_factory=dict)
    cost: dict[int, int] = field(default_factory=dict)

    def drop_before(self, lo: int) -> None:
        for series in (self.tokens, self.cost):
            for idx in [i for i in series if i < lo]:
                del series[idx]

    def current(self, window: Rolling, now_ms: int) -> tuple[int, int]:
        self.drop_before(now_ms // window.slice_ms - SLICES + 1)
        return sum(self.tokens.values()), sum(self.cost.values())


@dataclass(slots=True)
class _Bucket:
    holds: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # id: exp, tok, cost
    windows: dict[tuple[str, int], _Slices] = field(default_factory=dict)

    def prune(self, now_ms: int) -> tuple[int, int]:
        expired = [h for h, (exp, _, _) in self.holds.items() if exp <= now_ms]
        for hold_id in expired:
            del self.holds[hold_id]
        return (
            sum(t for _, t, _ in self.holds.values()),
            sum(c for _, _, c in self.holds.values()),
        )

    def slices(self, window: Rolling) -> _Slices:
        key = _window_key(window)
        found = self.windows.get(key)
        if found is None:
            found = self.windows[key] = _Slices()
        return found

    @property
    def empty(self) -> bool:
        return not self.holds and not any(s.tokens or s.cost for s in self.windows.values())


class MemoryBudgetStore:
    shared = False

    def __init__(self, *, max_buckets: int = 100_000) -> None:
        self._max = max_buckets
        self._buckets: dict[Bucket, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, bucket: Bucket, now_ms: int) -> _Bucket:
        found = self._buckets.get(bucket)
        if found is not None:
            return found
        if len(self._buckets) >= self._max:
            self._sweep(now_ms)
            if len(self._buckets) >= self._max:
                raise StoreFull(f"budget tracker holds {self._max} buckets")
        found = self._buckets[bucket] = _Bucket()
        return found

    def _sweep(self, now_ms: int) -> None:
        """Forget buckets whose windows have drained and whose holds have ended."""
        for bucket, state in list(self._buckets.items()):
            state.prune(now_ms)
            for window_key, slices in state.windows.items():
                seconds = window_key[1]
                slices.drop_before(now_ms // (seconds * 1000 // SLICES) - SLICES + 1)
            if state.empty:
                del self._buckets[bucket]

    # In this process nothing is sent: each call's work runs when it is awaited.
    def reserve(self, calls: Sequence[BucketCheck], hold: Hold) -> Awaitable[list[Reserved]]:
        return self._reserve(calls, hold)

    async def _reserve(self, calls: Sequence[BucketCheck], hold: Hold) -> list[Reserved]:
        return [self.reserve_one(call, hold) for call in calls]

    def reserve_one(self, call: BucketCheck, hold: Hold) -> Reserved:
        state = self._bucket(call.bucket, hold.now_ms)
        held_t, held_c = state.prune(hold.now_ms)
        used: list[int] = []
        for i, check in enumerate(call.checks):
            slices = state.slices(check.window)
            tokens, cost = slices.current(check.window, hold.now_ms)
            limit = check.limit
            if limit.tokens is not None and tokens + held_t + hold.tokens > limit.tokens:
                wait = retry_ms(
                    slices.tokens,
                    check.window,
                    hold.now_ms,
                    tokens + held_t,
                    hold.tokens,
                    limit.tokens,
                )
                return Reserved(False, window=i, unit=Unit.TOKENS, retry_ms=wait)
            if (
                hold.count_cost
                and limit.cost_micros is not None
                and cost + held_c + hold.cost > limit.cost_micros
            ):
                wait = retry_ms(
                    slices.cost,
                    check.window,
                    hold.now_ms,
                    cost + held_c,
                    hold.cost,
                    limit.cost_micros,
                )
                return Reserved(False, window=i, unit=Unit.USD, retry_ms=wait)
            used.append(tokens + held_t + hold.tokens)
        state.holds[hold.id] = (hold.expires_ms, hold.tokens, hold.cost)
        return Reserved(True, tuple(used))

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
    ) -> Awaitable[None]:
        return self._commit(calls, hold_id, now_ms, at_ms, tokens, cost)

    async def _commit(
        self,
        calls: Sequence[BucketCheck],
        hold_id: str,
        now_ms: int,
        at_ms: int,
        tokens: int,
        cost: int,
    ) -> None:
        for call in calls:
            state = self._bucket(call.bucket, now_ms)
            state.holds.pop(hold_id, None)
            for window in call.windows:
                idx = at_ms // window.slice_ms
                if idx < now_ms // window.slice_ms - SLICES + 1:
                    continue  # the request's slice already left this window
                slices = state.slices(window)
                slices.tokens[idx] = slices.tokens.get(idx, 0) + tokens
                slices.cost[idx] = slices.cost.get(idx, 0) + cost

    async def seed(
        self, call: BucketCheck, slices: Sequence[Sequence[tuple[int, int, int]]], ttl_ms: int
    ) -> bool:
        return False  # never unseeded: a process's counters live and die with it

    def release(self, buckets: Sequence[Bucket], hold_id: str) -> Awaitable[None]:
        return self._release(buckets, hold_id)

    async def _release(self, buckets: Sequence[Bucket], hold_id: str) -> None:
        for bucket in buckets:
            state = self._buckets.get(bucket)
            if state is not None:
                state.holds.pop(hold_id, None)

    async def inspect(self, call: BucketCheck, now_ms: int) -> BucketUsage:
        state = self._buckets.get(call.bucket) or _Bucket()
        held_t, held_c = state.prune(now_ms)
        rows = []
        for window in call.windows:
            slices = state.windows.get(_window_key(window)) or _Slices()
            tokens, cost = slices.current(window, now_ms)
            rows.append(WindowUsage(window, tokens, cost))
        return BucketUsage(call.bucket, held_t, held_c, tuple(rows))

    async def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    async def reset(self, bucket: Bucket, windows: Sequence[Rolling]) -> None:
        state = self._buckets.get(bucket)
        if state is not None:
            for window in windows:
                state.windows.pop(_window_key(window), None)

    async def aclose(self) -> None:
        return None
