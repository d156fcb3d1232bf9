"""The shared budget store: one Lua script per bucket per call, on Redis or Redis Cluster.

Keys of one bucket share one hash tag, so each script runs in one slot::

    {prefix}:{bk:<team>:<key>}:budget:holds        the key scope's holds (hash)
    {prefix}:{bk:<team>:<key>}:budget:expiry       their expiry times (zset)
    {prefix}:{bk:<team>:<key>}:budget:w:<id>:<s>   window <id> of <s> seconds: its slices
    {prefix}:{bm:<model>}:budget:...               a model's bucket (model name encoded)
    {prefix}:{bg}:budget:...                       the fleet's bucket

What is atomic: each script, on its bucket. A request's buckets live in up to three slots,
so its calls are separate scripts (sent together in one pipeline); when a later bucket
denies, the engine returns the holds the others took. In between, a concurrent request may
see those holds and be denied too: never an over-admission, at worst a spurious 429 under
contention at the limit. Keys live as long as the longest window plus the hold time, refreshed
on every write, whatever TTL the spend-limit keys use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from ..limits.model import Unit
from ..limits.windows import Rolling
from ..store.pipeline import ScriptPipeline, bounded_call, store_error
from ..store.redis import client_for
from .store import Bucket, BucketCheck, BucketUsage, Hold, Reserved, WindowUsage

T = TypeVar("T")
_SCRIPTS = ("reserve", "commit", "release", "inspect", "seed")
_UNITS = {1: Unit.TOKENS, 2: Unit.USD}


def _reserved(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and int(reply[0]) == 1


def _lua(name: str) -> str:
    folder = resources.files("spendguard.budgets") / "lua"
    common = (folder / "common.lua").read_text("utf-8")
    return common + "\n" + (folder / f"{name}.lua").read_text("utf-8")


class RedisBudgetStore:
    shared = True

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str,
        timeout: float = 0.5,
        require_seed: bool = False,
        pipeline: ScriptPipeline | None = None,
    ) -> None:
        # require_seed: a bucket Redis has no marker for is answered "unseeded" so the engine
        # rebuilds it from the ledger (after a restart) instead of starting from zero.
        self._require_seed = require_seed
        self._client = client
        self._prefix = prefix
        self._timeout = timeout
        self._scripts = {name: client.register_script(_lua(name)) for name in _SCRIPTS}
        # Given the spend store's pipeline, budget calls leave in the same pipeline writes as
        # the spend limits' (one round trip for both); the client and pipeline are then the
        # spend store's to close.
        self._owned = pipeline is None
        self.pipeline = pipeline or ScriptPipeline(client, timeout=timeout)
        # Per bucket check (by id, the check held so its id is not reused): its wire parts.
        self._wires: dict[int, tuple[BucketCheck, list[str], list[str], list[str]]] = {}

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str, timeout: float = 0.5, require_seed: bool = False
    ) -> RedisBudgetStore:
        return cls(
            client_for(url, timeout, max_connections=256),
            prefix=prefix,
            timeout=timeout,
            require_seed=require_seed,
        )

    # -- key names ------------------------------------------------------------------------
    def _base(self, bucket: Bucket) -> str:
        return f"{self._prefix}:{{{bucket.tag}}}:budget"

    def keys(self, bucket: Bucket, windows: Sequence[Rolling]) -> list[str]:
        """The bucket's keys: holds, expiry, then one per window (one hash tag, one slot)."""
        base = self._base(bucket)
        return [
            f"{base}:holds",
            f"{base}:expiry",
            *(f"{base}:w:{w.id}:{w.seconds}" for w in windows),
        ]

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await bounded_call(fn, self._timeout)

    async def _gather(self, calls: Sequence[Awaitable[Any]]) -> list[Any]:
        """Every call's reply; the calls were all submitted first, so they share a pipeline
        (on a cluster, one per node, in parallel)."""
        replies: list[Any] = []
        error: BaseException | None = None
        for call in calls:
            try:
                replies.append(await call)
            except Exception as exc:
                error = error or exc
                replies.append(None)
        if error is not None:
            raise error
        return replies

    # -- BudgetStore ------------------------------------------------------------------------
    # Each hot-path call is sent before it returns, into the pipeline's next write (with
    # whatever else this event-loop turn sends); the awaitable it returns has the answer.
    def reserve(self, calls: Sequence[BucketCheck], hold: Hold) -> Awaitable[list[Reserved]]:
        head = [
            str(hold.now_ms),
            hold.id,
            str(hold.expires_ms),
            str(hold.tokens),
            str(hold.cost),
            "1" if hold.count_cost else "0",
            str(hold.ttl_ms),
            "1" if self._require_seed else "0",
        ]
        pending = []
        script = self._scripts["reserve"]
        for call in calls:
            keys, limits, _ = self._wire_of(call)
            pending.append(self.pipeline.submit(script, keys, head + limits))
        return self._reserved(calls, hold, pending)

    def _wire_of(self, call: BucketCheck) -> tuple[list[str], list[str], list[str]]:
        """A bucket check's keys, its reserve's window arguments and its commit's, made once
        per check (a gate reuses a plan's checks) and kept, bounded, with the check."""
        found = self._wires.get(id(call))
        if found is not None and found[0] is call:
            return found[1], found[2], found[3]
        limits: list[str] = []
        for check in call.checks:
            lim = check.limit
            limits += [
                str(check.window.slice_ms),
                "-" if lim.tokens is None else str(lim.tokens),
                "-" if lim.cost_micros is None else str(lim.cost_micros),
            ]
        keys = self.keys(call.bucket, call.windows)
        slices = [str(w.slice_ms) for w in call.windows]
        if len(self._wires) >= 10_000:
            self._wires.clear()
        self._wires[id(call)] = (call, keys, limits, slices)
        return keys, limits, slices

    async def _reserved(
        self, calls: Sequence[BucketCheck], hold: Hold, pending: Sequence[Awaitable[Any]]
    ) -> list[Reserved]:
        replies: list[Any] = []
        for waiting in pending:
            try:
                replies.append(await waiting)
            except Exception as exc:
                replies.append(exc)
        failed = next((r for r in replies if isinstance(r, Exception)), None)
        if failed is not None:
            # Buckets that reserved before another call failed give their holds back (best
            # effort; they would expire anyway), so a fail-open retry doesn't count twice.
            taken = [c.bucket for c, r in zip(calls, replies, strict=True) if _reserved(r)]
            if taken:
                with contextlib.suppress(Exception):
                    await self.release(taken, hold.id)
            raise failed
        out = []
        for raw in replies:
            if int(raw[0]) == -1:
                out.append(Reserved(False, unseeded=True))
            elif int(raw[0]) == 1:
                out.append(Reserved(True, tuple(int(x) for x in raw[1:])))
            else:
                unit = _UNITS[int(raw[2])]
                out.append(Reserved(False, window=int(raw[1]) - 1, unit=unit, retry_ms=int(raw[3])))
        return out

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
    ) -> Awaitable[list[Any]]:
        head = [str(now_ms), hold_id, str(at_ms), str(tokens), str(cost), str(ttl_ms)]
        script = self._scripts["commit"]
        pending = []
        for call in calls:
            keys, _, slices = self._wire_of(call)
            pending.append(self.pipeline.submit(script, keys, head + slices))
        return self._gather(pending)

    async def seed(
        self, call: BucketCheck, slices: Sequence[Sequence[tuple[int, int, int]]], ttl_ms: int
    ) -> bool:
        args = [str(ttl_ms)]
        for rows in slices:
            args.append(str(len(rows)))
            for idx, tokens, cost in rows:
                args += [str(idx), str(tokens), str(cost)]
        # Pipelined like the hot calls: after a restart every request finds its buckets lost at
        # once, and one connection per seed would exhaust the pool.
        keys = self.keys(call.bucket, call.windows)
        return bool(int(await self.pipeline.submit(self._scripts["seed"], keys, args)))

    def release(self, buckets: Sequence[Bucket], hold_id: str) -> Awaitable[list[Any]]:
        pending = [
            self.pipeline.submit(self._scripts["release"], self.keys(b, ()), [hold_id])
            for b in buckets
        ]
        return self._gather(pending)

    async def inspect(self, call: BucketCheck, now_ms: int) -> BucketUsage:
        script = self._scripts["inspect"]
        keys = self.keys(call.bucket, call.windows)
        args = [str(now_ms), *(str(w.slice_ms) for w in call.windows)]
        raw = await self._call(lambda: script(keys=keys, args=args))
        values = [int(x) for x in raw]
        rows = tuple(
            WindowUsage(w, values[2 + 2 * i], values[3 + 2 * i]) for i, w in enumerate(call.windows)
        )
        return BucketUsage(call.bucket, values[0], values[1], rows)

    async def reset(self, bucket: Bucket, windows: Sequence[Rolling]) -> None:
        keys = self.keys(bucket, windows)[2:]
        if keys:
            await self._call(lambda: self._client.delete(*keys))

    async def buckets(self) -> list[Bucket]:
        """Every bucket with keys in Redis (for a reset of a whole scope; SCAN, not KEYS)."""
        from .config import Scope

        scopes = {"bk": Scope.PER_API_KEY, "bm": Scope.PER_MODEL, "bg": Scope.GLOBAL}
        found: set[Bucket] = set()

        async def scan() -> None:
            async for key in self._client.scan_iter(match=f"{self._prefix}:{{b*}}:budget:*"):
                tag = key[len(self._prefix) + 2 : key.index("}")]
                kind, _, subject = tag.partition(":")
                if kind in scopes:
                    found.add(Bucket(scopes[kind], subject))

        try:
            with anyio.fail_after(max(self._timeout * 20, 5.0)):
                await scan()
        except (RedisError, OSError, TimeoutError) as exc:
            raise store_error(exc) from exc
        return sorted(found, key=lambda b: (b.scope.value, b.subject))

    async def aclose(self) -> None:
        if self._owned:
            await self.pipeline.aclose()
            await self._client.aclose()
