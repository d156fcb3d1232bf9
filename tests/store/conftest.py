"""The one store contract's harness: every ``test_contract*`` module runs on the embedded
store, one real redis-server and a real 3-master Redis Cluster, through the one
:class:`~spendguard.store.Store` Protocol.

Time is real for Redis, so the harness exposes ``advance(seconds)``: the memory store's clock
jumps, Redis sleeps. Calls that take the time as an argument (provider capacity, rolling
windows) are driven by a test's own frozen clock on all three.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import anyio
import pytest

from spendguard.store import Store
from spendguard.store.memory import MemoryStore
from spendguard.store.redis import RedisStore
from tests.support import Clock


@dataclass
class Harness:
    store: Store
    now: Callable[[], datetime]
    advance: Callable[[float], Awaitable[None]]
    kind: str


@pytest.fixture(params=["memory", "redis", "cluster"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        clock = Clock(datetime.now(UTC))

        async def jump(seconds: float) -> None:
            clock.now += timedelta(seconds=seconds)

        yield Harness(MemoryStore(max_keys=1000, clock=clock), clock, jump, "memory")
    else:
        if request.param == "redis":
            url: str = request.getfixturevalue("redis_url")
        else:
            cluster = request.getfixturevalue("redis_cluster")
            cluster.flushall()
            url = cluster.url  # redis+cluster://127.0.0.1:port
        store = RedisStore.from_url(url, prefix="quota", timeout=2.0)

        async def sleep(seconds: float) -> None:
            await anyio.sleep(seconds)

        try:
            yield Harness(store, lambda: datetime.now(UTC), sleep, "redis")
        finally:
            await store.aclose()
