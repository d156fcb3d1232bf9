"""Where the Redis store's time goes: one preflight at each layer of the client path.

The same EVALSHA of spendguard's preflight script, with the same keys and arguments, on a warm
key, sent four ways:

* ``spendguard``: ``RedisStore.preflight`` as shipped: the store's pipeline sends the calls of
  concurrent requests as one pipeline (redis-py connections driven directly, hiredis packing
  and parsing, one deadline per batch), then the decision on the reply;
* ``redis-py``: redis-py's ``Script`` call alone, one call per round trip through the pool
  (the script text is the store's own ``spendguard/store/lua/preflight.lua``, so it has the
  same SHA; the client has the store's kind of pool);
* ``minimal``: a ~60-line asyncio protocol speaking RESP2 on one connection, which writes every
  call issued in the same event-loop turn in one ``write`` (automatic pipelining), its replies
  parsed in Python;
* ``minimal, hiredis``: the same protocol with hiredis's reply parser.

At concurrency 1 the difference is the per-call cost of each client path; at concurrency 64 it
is what pipelining concurrent preflights into shared round trips buys (``spendguard`` also
reports how many calls one of its pipelines carried). The minimal clients are a measuring
stick for a leaner path, not a proposal to ship as is (no reconnects, no cluster, no timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import resource
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any, Self
from urllib.parse import urlsplit

import hiredis
import redis.asyncio as aioredis

from spendguard import Identity
from spendguard.limits import KeyCodec
from spendguard.store.pipeline import _Connections
from spendguard.store.redis import RedisStore

from .common import Sizes
from .settlement import warm_preflight_keys
from .stats import percentile, summary

Reply = Any


def pack(*parts: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _parse(buf: bytearray, pos: int) -> tuple[Reply, int] | None:
    """One RESP2 reply at ``pos``: (value, next position), or None if incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    nxt = end + 2
    if kind == b"+":
        return line.decode(), nxt
    if kind == b"-":
        return RuntimeError(line.decode()), nxt
    if kind == b":":
        return int(line), nxt
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, nxt
        if len(buf) < nxt + size + 2:
            return None
        return bytes(buf[nxt : nxt + size]).decode(), nxt + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, nxt
        items = []
        for _ in range(count):
            parsed = _parse(buf, nxt)
            if parsed is None:
                return None
            item, nxt = parsed
            items.append(item)
        return items, nxt
    raise ValueError(f"bad RESP type {kind!r}")


class MinimalRedis(asyncio.Protocol):
    """Calls made in one loop turn leave in one write; replies come back in order."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._waiters: deque[asyncio.Future[Reply]] = deque()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    @classmethod
    async def connect(cls, url: str) -> Self:
        parts = urlsplit(url)
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            cls, parts.hostname or "127.0.0.1", parts.port or 6379
        )
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        pos = 0
        while self._waiters:
            parsed = _parse(self._buf, pos)
            if parsed is None:
                break
            value, pos = parsed
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(value)
        del self._buf[:pos]

    def _flush(self) -> None:
        assert self._transport is not None
        self._transport.write(b"".join(self._out))
        self._out = []

    def call(self, packed: bytes) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        if not self._out:
            loop.call_soon(self._flush)
        self._out.append(packed)
        fut: asyncio.Future[Reply] = loop.create_future()
        self._waiters.append(fut)
        return fut

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class HiredisMinimal(MinimalRedis):
    """The same protocol, its replies parsed by hiredis (C) instead of ``_parse``."""

    def __init__(self) -> None:
        super().__init__()
        self._reader = hiredis.Reader(encoding="utf-8")

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while self._waiters:
            reply = self._reader.gets()
            if reply is False:  # incomplete: wait for more bytes
                break
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(reply)


async def _timed(
    fn: Callable[[], Awaitable[Any]], calls: int, concurrency: int
) -> dict[str, float]:
    samples: list[int] = []
    clock = time.perf_counter_ns

    async def worker(n: int) -> None:
        for _ in range(n):
            start = clock()
            await fn()
            samples.append(clock() - start)

    per = max(1, calls // concurrency)
    cpu_before = _cpu_seconds()
    start = time.perf_counter()
    await asyncio.gather(*(worker(per) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_before
    return {
        "p50_us": percentile(samples, 50) / 1000,
        "p99_us": percentile(samples, 99) / 1000,
        "calls_per_s": len(samples) / elapsed,
        # This process's CPU (user + system) per call: what the client path costs the
        # gateway, whatever the server's speed. The server is another process.
        "cpu_us_per_call": cpu / len(samples) * 1e6,
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _preflight_lua() -> str:
    """The store's preflight script, read from the package as the store reads it."""
    lua = resources.files("spendguard.store") / "lua" / "preflight.lua"
    return lua.read_text("utf-8")


def _client(url: str, timeout: float) -> aioredis.Redis:
    """A redis-py client like the store's: a blocking pool, decoded replies, one timeout."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=512,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        decode_responses=True,
    )
    return aioredis.Redis(connection_pool=pool)


async def _measure(redis_url: str, sizes: Sizes, repeats: int) -> dict[str, Any]:
    identity = Identity("client-path", "key")
    store = RedisStore.from_url(redis_url, timeout=5.0)
    await warm_preflight_keys(store, identity)
    # The same store on redis-py's connections (what it uses for TLS, a credential provider
    # or RESP3) instead of its own (store/wire.py).
    on_redis_py = RedisStore.from_url(redis_url, timeout=5.0)
    on_redis_py.pipeline._transport = _Connections(on_redis_py.pipeline._client)
    keys = KeyCodec("quota", timedelta(days=2)).plan(identity, datetime.now(UTC))
    client = _client(redis_url, timeout=5.0)
    script = client.register_script(_preflight_lua())  # same Lua, so the store's SHA
    redis_keys = [keys.policy_key, *(c.usage_key for c in keys.checks), *keys.rate_keys]
    # The store's own layout: the number of fields, the fields, a record id, a hold, a model
    # (none here, as in the store call above), the model-list and rate fields, the time, the
    # tokens a TPM rate reserves and the in-flight deadline.
    args = [str(len(keys.checks)), *(c.field for c in keys.checks), "", "0", ""]
    args += [*keys.allow_fields, *keys.rate_fields, str(int(time.time() * 1000)), "0", "600000"]
    packed = pack("EVALSHA", script.sha, str(len(redis_keys)), *redis_keys, *args)
    minimal = await MinimalRedis.connect(redis_url)
    fast = await HiredisMinimal.connect(redis_url)
    clients: dict[str, Callable[[], Awaitable[Any]]] = {
        "spendguard": lambda: store.preflight(keys),
        "spendguard, redis-py connections": lambda: on_redis_py.preflight(keys),
        "redis-py": lambda: script(keys=redis_keys, args=args),
        "minimal": lambda: minimal.call(packed),
        "minimal, hiredis": lambda: fast.call(packed),
    }
    try:
        reply = await clients["redis-py"]()
        expected = [str(x) if x is not None else None for x in reply]
        for name in ("minimal", "minimal, hiredis"):
            check = await clients[name]()
            if expected != check:
                raise RuntimeError(f"{name} client disagrees: {check!r} != {reply!r}")
        raw: dict[str, dict[str, list[float]]] = {}
        for fn in clients.values():
            await _timed(fn, 640, 64)  # warm-up: the pool opens its connections now
        for _ in range(repeats):
            for conc in (1, 64):
                for name, fn in clients.items():
                    pipe = (on_redis_py if "redis-py connections" in name else store).pipeline
                    sent = dataclasses.replace(pipe.stats)
                    res = await _timed(fn, sizes.client_calls, conc)
                    if name.startswith("spendguard"):
                        now = pipe.stats
                        res["calls_per_round_trip"] = (now.calls - sent.calls) / max(
                            1, now.batches - sent.batches
                        )
                    entry = raw.setdefault(f"{name}, concurrency {conc}", {})
                    for stat, value in res.items():
                        entry.setdefault(stat, []).append(value)
    finally:
        minimal.close()
        fast.close()
        await client.aclose()
        await store.aclose()
        await on_redis_py.aclose()
    return {
        label: {stat: summary(values) for stat, values in stats.items()}
        for label, stats in raw.items()
    }


def measure(redis_url: str, sizes: Sizes, repeats: int) -> dict[str, Any]:
    return asyncio.run(_measure(redis_url, sizes, repeats))
