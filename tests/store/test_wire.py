"""The hot path's own Redis connections (store/wire.py) against real redis-server processes:
a password and a database in the URL, a Unix socket, a refused login, a reply stream that
stays in step after a deadline, and the clients it leaves to redis-py's connections. Each runs
on asyncio's event loop and on uvloop, whose transports are not asyncio's classes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.credentials import UsernamePasswordCredentialProvider

from spendguard import Identity
from spendguard.clock import utcnow
from spendguard.errors import StoreUnavailable
from spendguard.limits import KeyCodec, KeyPlan, Limit, Period
from spendguard.limits.codec import field_of
from spendguard.store import Outcome, UsageFill
from spendguard.store.redis import RedisStore
from spendguard.store.wire import WireConnections, WireProtocol
from tests.support import Gateway, RedisServer
from tests.support.loops import running_loop_name

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]

CODEC = KeyCodec("wire", timedelta(days=2))


def plan(team: str) -> KeyPlan:
    return CODEC.plan(Identity(team, "k"), datetime.now(UTC))


async def warm(store: RedisStore, p: KeyPlan, used: int = 0) -> None:
    fields = {field_of(c.target): 10**9 for c in p.checks if isinstance(c.target, Limit)}
    usage = [UsageFill(c.usage_key, used, c.expires_at) for c in p.checks]
    await store.fill(p, fields, usage, policy_ttl=60)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    # A user with a password next to the default one (which the test harness itself uses).
    sock = tmp_path / "redis.sock"
    with RedisServer(extra_args=["--unixsocket", str(sock), "--unixsocketperm", "700"]) as srv:
        srv.cli("ACL", "SETUSER", "gw", "on", ">s3cret", "~*", "&*", "+@all")
        yield srv


def evalsha_clients(server: RedisServer) -> list[str]:
    return [line for line in server.cli("CLIENT", "LIST").splitlines() if "cmd=evalsha" in line]


async def test_a_password_and_a_database_reach_the_hot_path(server: RedisServer) -> None:
    store = RedisStore.from_url(f"redis://gw:s3cret@{server.host}:{server.port}/3", timeout=2)
    assert isinstance(store.pipeline._transport, WireConnections)
    p = plan("acme")
    await warm(store, p)
    results = await asyncio.gather(*(store.preflight(p) for _ in range(20)))
    assert all(pf.outcome is Outcome.ALLOW for pf in results)
    # The scripts ran as that user, on database 3, where the fill put the keys.
    clients = evalsha_clients(server)
    assert clients and all("user=gw" in line and " db=3 " in line for line in clients)
    assert int(server.cli("-n", "3", "DBSIZE")) > 0
    assert int(server.cli("-n", "0", "DBSIZE")) == 0
    await store.aclose()


async def test_a_unix_socket_reaches_the_hot_path(server: RedisServer, tmp_path: Path) -> None:
    store = RedisStore.from_url(f"unix://{tmp_path / 'redis.sock'}?db=2", timeout=2)
    assert isinstance(store.pipeline._transport, WireConnections)
    p = plan("acme")
    await warm(store, p)
    assert (await store.preflight(p)).outcome is Outcome.ALLOW
    assert any(" db=2 " in line for line in evalsha_clients(server))
    await store.aclose()


async def test_a_refused_login_is_the_store_unavailable(server: RedisServer) -> None:
    store = RedisStore.from_url(f"redis://gw:wrong@{server.host}:{server.port}/0", timeout=2)
    with pytest.raises(StoreUnavailable, match="setup"):
        await store.preflight(plan("acme"))
    await store.aclose()


async def test_replies_after_a_deadline_never_reach_the_next_batch(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url, timeout=0.2)
    slow, fast = plan("slow"), plan("fast")
    await warm(store, slow, used=111)
    await warm(store, fast, used=222)
    server.pause()
    try:
        with pytest.raises(StoreUnavailable):
            await store.preflight(slow)
    finally:
        server.resume()
    # The paused batch's reply arrives on a socket that was dropped; each caller gets its own.
    for p, used in ((fast, 222), (slow, 111), (fast, 222)):
        pf = await store.preflight(p)
        assert pf.outcome is Outcome.ALLOW
        assert [s.used for s in pf.limits] == [used] * len(pf.limits)
    await store.aclose()


async def test_clients_it_cannot_speak_for_keep_redis_py_connections(server: RedisServer) -> None:
    # A credential provider (or TLS, or RESP3) is redis-py's business: the hot path uses its
    # connections, and works the same.
    client = aioredis.Redis(
        host=server.host,
        port=server.port,
        decode_responses=True,
        credential_provider=UsernamePasswordCredentialProvider("gw", "s3cret"),
    )
    store = RedisStore(client, timeout=2)
    assert not isinstance(store.pipeline._transport, WireConnections)
    p = plan("acme")
    await warm(store, p)
    assert (await store.preflight(p)).outcome is Outcome.ALLOW
    assert any("user=gw" in line for line in evalsha_clients(server))
    await store.aclose()


class _ForeignTransport:
    """A stream transport as another event loop makes one: asyncio's interface, none of its
    classes (uvloop's TCP transport is like this)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


async def test_a_transport_that_is_no_asyncio_class_carries_batches() -> None:
    assert not isinstance(_ForeignTransport(), asyncio.BaseTransport)
    proto = WireProtocol()
    transport = _ForeignTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    replies = proto.exchange(b"*1\r\n$4\r\nPING\r\n", 1)
    assert transport.written == [b"*1\r\n$4\r\nPING\r\n"]
    proto.data_received(b"+PONG\r\n")
    assert await replies == ["PONG"]
    proto.close()
    assert transport.aborted and proto.closed


async def test_the_middleware_admits_through_the_wire_on_every_event_loop(
    loop: str, redis_url: str, tmp_path: Path
) -> None:
    # uvicorn runs on uvloop wherever it is installed: a hot path that only spoke to asyncio's
    # own transports answered every inference there with a 503, Redis healthy.
    assert running_loop_name() == loop
    store = RedisStore.from_url(redis_url, timeout=2)
    assert isinstance(store.pipeline._transport, WireConnections)
    try:
        async with Gateway(tmp_path, utcnow, store=store) as gw:
            await gw.policy(Period.DAY, 10**9)
            statuses = [(await gw.post()).status_code]  # the first connects and fills
            statuses += [
                r.status_code for r in await asyncio.gather(*(gw.post() for _ in range(20)))
            ]
            assert statuses == [200] * 21
            assert gw.store.calls["preflight"] >= 21 and gw.postflights == 21
    finally:
        await store.aclose()
