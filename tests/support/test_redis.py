"""The Redis fixtures start real, private servers that behave like crashed/restarted/hung ones."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tests.support import RedisCluster, RedisServer, RedisServerError
from tests.support.services import require_redis_server

pytestmark = pytest.mark.anyio

SHARED_REDIS_PORT = 6379


def client(url: str, **kwargs: Any) -> aioredis.Redis:
    # No retries: redis-py's default would retry a dead server with backoff, hiding (and
    # slowing down) exactly the failures these tests provoke.
    return aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kwargs)


async def test_set_get_on_private_server(redis_url: str, shared_redis: RedisServer) -> None:
    assert shared_redis.port != SHARED_REDIS_PORT
    assert redis_url == f"redis://127.0.0.1:{shared_redis.port}/0"
    r = client(redis_url)
    try:
        await r.set("k", "v")
        assert await r.get("k") == b"v"
    finally:
        await r.aclose()


async def test_redis_url_is_flushed_before_each_test(
    redis_url: str, shared_redis: RedisServer
) -> None:
    # Runs after the test above wrote "k": the fixture's FLUSHALL must have removed it.
    assert shared_redis.cli("DBSIZE").strip() == "0"
    assert "cmdstat_flushall" in shared_redis.cli("INFO", "commandstats")


async def test_kill_drops_connections(redis_server: RedisServer) -> None:
    r = client(redis_server.url)
    try:
        await r.set("k", "v")
        redis_server.kill()
        assert not redis_server.running
        with pytest.raises(redis.exceptions.ConnectionError):
            await r.get("k")
    finally:
        await r.aclose()


async def test_restart_keeps_port_and_loses_keys(redis_server: RedisServer) -> None:
    url = redis_server.url
    r = client(url)
    try:
        await r.set("k", "v")
    finally:
        await r.aclose()
    redis_server.restart()
    assert redis_server.url == url
    r = client(url)
    try:
        assert await r.ping()
        assert await r.get("k") is None
    finally:
        await r.aclose()


async def test_pause_hangs_and_resume_answers(redis_server: RedisServer) -> None:
    r = client(redis_server.url, socket_timeout=0.2)
    try:
        await r.set("k", "v")
        redis_server.pause()
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await r.get("k")
        assert time.monotonic() - started < 2
        redis_server.resume()
        assert await r.get("k") == b"v"
    finally:
        await r.aclose()


def test_explicit_port_in_use_is_an_error() -> None:
    require_redis_server()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = RedisServer(port=taken.getsockname()[1])
        with pytest.raises(RedisServerError, match="in use"):
            server.start()
        server.stop()


def test_extra_args_and_context_manager() -> None:
    require_redis_server()
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]) as server:
        assert "allkeys-lru" in server.cli("CONFIG", "GET", "maxmemory-policy")
        pid = server.pid
        directory = server.directory
    assert not server.running
    assert pid is not None and directory is not None and not directory.exists()


async def test_cluster_hash_tag_keys_share_a_slot(redis_cluster: RedisCluster) -> None:
    assert len(redis_cluster.nodes) == 3
    first = redis_cluster.nodes[0]
    assert redis_cluster.url == f"redis+cluster://{first[0]}:{first[1]}"
    assert redis_cluster.slot_of("{team}") == redis_cluster.slot_of("{team}:x")

    rc = aioredis.RedisCluster.from_url(f"redis://{first[0]}:{first[1]}")
    try:
        await rc.set("{team}", "a")
        await rc.set("{team}:x", "b")
        assert await rc.get("{team}") == b"a"
        assert await rc.get("{team}:x") == b"b"
    finally:
        await rc.aclose()
