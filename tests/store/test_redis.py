"""The middleware on the Redis store, against real redis-server processes.

Round trips on the hot path, miss recovery, fail modes (refused, hung), restarts and script
flushes in the middle of traffic, the eviction-policy warning, cluster slots. On asyncio's event
loop and on uvloop.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from spendguard import Identity, Settings
from spendguard.clock import utcnow
from spendguard.limits import KeyCodec, Period, key_limit
from spendguard.store import RefreshEntry, UsageFill
from spendguard.store.redis import MARKER_PAGE, REFRESH_IDS, RedisStore
from tests.support import Gateway, RedisCluster, RedisServer, chat_body

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]


@pytest.fixture
async def redis_gw(tmp_path: Path, redis_url: str) -> AsyncIterator[Gateway]:
    store = RedisStore.from_url(redis_url, timeout=1.0)
    async with Gateway(tmp_path, utcnow, store=store) as gateway:
        yield gateway
    await store.aclose()


def metric(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def data_commands(server: RedisServer) -> dict[str, int]:
    stats = server.cli("INFO", "commandstats")
    calls = {m[0]: int(m[1]) for m in re.findall(r"cmdstat_([a-z|]+):calls=(\d+)", stats)}
    # Housekeeping from the test itself or the client, not the request's work.
    return {k: v for k, v in calls.items() if k.split("|")[0] not in {"info", "config", "ping"}}


async def test_warm_inference_is_two_round_trips_and_no_sql(
    redis_gw: Gateway, shared_redis: RedisServer
) -> None:
    await redis_gw.policy(Period.DAY, 10**9)
    await redis_gw.policy(Period.MONTH, 10**9, key=None)
    async with redis_gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200  # warm
        await redis_gw.guard.recorder.flush()
        submitted: list[Any] = []
        redis_gw.guard.recorder.submit = submitted.append  # type: ignore[assignment,method-assign]
        store_calls, ledger_calls = dict(redis_gw.store.calls), dict(redis_gw.ledger.calls)
        shared_redis.cli("CONFIG", "RESETSTAT")
        r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    made = {k: v - store_calls.get(k, 0) for k, v in redis_gw.store.calls.items()}
    assert {k: v for k, v in made.items() if v} == {"preflight": 1, "postflight": 1}
    assert data_commands(shared_redis)["evalsha"] == 2  # and the server saw exactly those
    assert dict(redis_gw.ledger.calls) == ledger_calls  # no ledger call, so no SQL
    assert len(submitted) == 1  # the record went to the background writer


@pytest.mark.parametrize("rated", [False, True])
async def test_rates_add_no_round_trip_and_no_key_without_rates(
    redis_gw: Gateway, shared_redis: RedisServer, rated: bool
) -> None:
    await redis_gw.policy(Period.DAY, 10**9)
    if rated:
        await redis_gw.guard.admin.set_rates("acme", "alpha", rpm=100, tpm=10**6, max_parallel=5)
        await redis_gw.guard.admin.set_rates("acme", None, rpm=1000, max_parallel=50)
    async with redis_gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200  # warm
        shared_redis.cli("CONFIG", "RESETSTAT")
        r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    assert data_commands(shared_redis)["evalsha"] == 2  # the rates ride in the same scripts
    rate_keys = sorted(k for k in shared_redis.cli("KEYS", "*").split() if ":rate:" in k)
    if not rated:
        assert rate_keys == []  # no rates: nothing is counted anywhere
        return
    assert rate_keys == ["quota:{acme}:spend:rate:api_key:alpha", "quota:{acme}:spend:rate:team"]
    for key in rate_keys:  # two requests counted, none left in flight
        fields = shared_redis.cli("HGETALL", key).split()
        counted = dict(zip(fields[::2], fields[1::2], strict=True))
        assert counted["r"] == "2" and "n" not in counted
        assert not any(f.startswith("f:") for f in counted)


async def test_concurrent_misses_make_one_ledger_read(redis_gw: Gateway) -> None:
    await redis_gw.policy(Period.DAY, 10**9)
    loads = {"policies": 0, "aggregates": 0}
    ledger = redis_gw.guard.ledger
    real_p, real_a = ledger.load_limits, ledger.load_aggregates

    async def slow_policies(*args: Any) -> Any:
        loads["policies"] += 1
        await anyio.sleep(0.05)
        return await real_p(*args)

    async def slow_aggregates(*args: Any) -> Any:
        loads["aggregates"] += 1
        await anyio.sleep(0.05)
        return await real_a(*args)

    ledger.load_limits = slow_policies  # type: ignore[method-assign]
    ledger.load_aggregates = slow_aggregates  # type: ignore[method-assign]
    statuses: list[int] = []
    async with redis_gw.client() as c:

        async def one() -> None:
            statuses.append((await c.post("/v1/chat/completions", json=chat_body())).status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(one)
    assert statuses == [200] * 100
    assert loads == {"policies": 1, "aggregates": 1}


async def test_no_aggregate_in_the_ledger_starts_at_zero(redis_gw: Gateway) -> None:
    await redis_gw.policy(Period.DAY, 15)
    async with redis_gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 429


@pytest.mark.parametrize("mode", ["closed", "open"])
async def test_refused_connection_fail_modes(tmp_path: Path, mode: str) -> None:
    server = RedisServer().start()
    url = server.url
    server.stop()  # nothing listens on that port now: connections are refused
    store = RedisStore.from_url(url, timeout=0.2)
    action = "deny" if mode == "closed" else "allow"
    before = metric("spendguard_store_unavailable_total", action=action)
    async with Gateway(tmp_path, utcnow, store=store, fail_mode=mode) as gw, gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body())
        assert metric("spendguard_store_unavailable_total", action=action) == before + 1
        if mode == "closed":
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert len(gw.guard.outage) == 0
        else:
            assert r.status_code == 200
            assert gw.guard.outage.spent(Identity("acme", "alpha")) == (1, 15)
            await gw.guard.recorder.flush()
            assert (await gw.guard.ledger.unsettled())[0] == 1  # recorded for settlement
    await store.aclose()


async def test_fail_open_tracker_is_bounded(tmp_path: Path) -> None:
    server = RedisServer().start()
    url = server.url
    server.stop()
    store = RedisStore.from_url(url, timeout=0.2)
    async with (
        Gateway(tmp_path, utcnow, store=store, fail_mode="open", fail_open_max_keys=1) as gw,
        gw.client() as c,
    ):
        first = await c.post("/v1/chat/completions", json=chat_body())
        other = await c.post(
            "/v1/chat/completions", json=chat_body(), headers={"x-test-key": "beta"}
        )
    assert first.status_code == 200 and other.status_code == 503
    await store.aclose()


@pytest.mark.parametrize("mode", ["closed", "open"])
async def test_hung_redis_costs_at_most_the_timeout(
    tmp_path: Path, redis_server: RedisServer, mode: str
) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=0.2)
    async with Gateway(tmp_path, utcnow, store=store, fail_mode=mode) as gw:
        await gw.policy(Period.DAY, 10**9)
        async with gw.client() as c:
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
            redis_server.pause()
            try:
                started = time.monotonic()
                r = await c.post("/v1/chat/completions", json=chat_body())
                elapsed = time.monotonic() - started
            finally:
                redis_server.resume()
        assert r.status_code == (503 if mode == "closed" else 200)
        # Bounded by the timeout (0.2 s per call), not by the hang: generous margin for CI.
        assert elapsed < 2.0
    await store.aclose()


async def test_restart_and_script_flush_mid_traffic(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=1.0)
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        await gw.policy(Period.DAY, 10**9)
        statuses: list[int] = []
        async with gw.client() as c:

            async def burst(n: int) -> None:
                for _ in range(n):
                    statuses.append(
                        (await c.post("/v1/chat/completions", json=chat_body())).status_code
                    )

            await burst(5)
            await gw.settle()
            redis_server.cli("SCRIPT", "FLUSH")
            await burst(5)
            redis_server.restart()  # every key and script is gone; pooled sockets are dead
            await burst(5)
        assert statuses == [200] * 15
        # The keys lost in the restart were rebuilt from the ledger: settled 5 requests, plus
        # pending estimates of the 10 after it that were not settled.
        alpha_day = key_limit(Identity("acme", "alpha"), Period.DAY)
        key = gw.guard.codec.check(alpha_day, utcnow()).usage_key
        cached = (await store.read_usage([key]))[key]
        await gw.settle()
        assert cached is not None and 5 * 15 <= cached <= 15 * 15
        assert (await store.read_usage([key]))[key] == await gw.guard.ledger.charges_total()
    await store.aclose()


async def test_eviction_policy_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]) as server:
        store = RedisStore.from_url(server.url)
        caplog.set_level(logging.WARNING, "spendguard.store")
        async with Gateway(tmp_path, utcnow, store=store):
            pass
        assert "allkeys-lru" in caplog.text and "noeviction" in caplog.text
        await store.aclose()


async def test_cluster_keys_of_a_request_share_the_team_slot(redis_cluster: RedisCluster) -> None:
    hostile = ["acme", "a{b}", "}{", "a:b", "a\nb", "", "x" * 10_000, "é", "e\u0301"]
    for raw in hostile:
        team = raw or "empty-key-only"
        for key in (raw or None, "k"):
            p = KeyCodec("quota", timedelta(days=2)).plan(Identity(team, key), utcnow())
            slots = {
                redis_cluster.slot_of(k) for k in [p.policy_key, *(c.usage_key for c in p.checks)]
            }
            assert len(slots) == 1, (raw, slots)


async def test_cluster_gateway_end_to_end(tmp_path: Path, redis_cluster: RedisCluster) -> None:
    redis_cluster.flushall()
    store = RedisStore.from_url(redis_cluster.url, timeout=2.0)
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        await gw.policy(Period.DAY, 30)
        async with gw.client() as c:
            codes = [
                (await c.post("/v1/chat/completions", json=chat_body())).status_code
                for _ in range(3)
            ]
        assert codes == [200, 200, 429]
        await gw.settle()
        alpha_day = key_limit(Identity("acme", "alpha"), Period.DAY)
        assert await gw.aggregates() == {(alpha_day, Period.DAY.bucket(utcnow())): 30}
    await store.aclose()


async def test_a_reconcile_reads_a_large_backlog_of_markers_in_short_calls(
    redis_url: str,
) -> None:
    # After a long ledger outage a key holds a marker per unsettled record. Reading them must
    # not be one call that holds Redis (and every gateway's hot path) for all of them.
    store = RedisStore.from_url(redis_url, timeout=2.0)
    p = KeyCodec("quota", timedelta(days=2)).plan(Identity("acme", "alpha"), utcnow())
    day = p.checks[0].usage_key
    await store.fill(p, {}, [UsageFill(day, 0, p.checks[0].expires_at)], policy_ttl=60)
    ids = [f"r{i:06d}" for i in range(12_000)]
    for start in range(0, len(ids), 1000):
        async with anyio.create_task_group() as tg:
            for rid in ids[start : start + 1000]:
                tg.start_soon(store.postflight, rid, 1, [day])
    admin = redis.Redis.from_url(redis_url)
    admin.config_set("slowlog-max-len", 100_000)
    admin.config_set("slowlog-log-slower-than", 0)  # log every command
    admin.slowlog_reset()
    try:
        got = await store.pending_records([day])
        log = admin.slowlog_get(100_000)
    finally:
        admin.config_set("slowlog-log-slower-than", 10_000)
        admin.close()
        await store.aclose()
    assert sorted(got[day]) == ids
    # What the server was asked (but this check's own SLOWLOG calls): short paged reads, no
    # command that walks the whole hash (a script, HKEYS, HGETALL).
    housekeeping = {b"SLOWLOG", b"HELLO", b"PING", b"CLIENT", b"SELECT", b"AUTH"}  # connecting
    asked = [e["command"].split()[0].upper() for e in log]
    asked = [c for c in asked if c not in housekeeping]
    assert set(asked) == {b"HSCAN"}, set(asked)
    assert len(asked) >= len(ids) // MARKER_PAGE


async def test_a_refresh_after_a_settlement_backlog_is_short_calls(redis_url: str) -> None:
    # A worker catching up settles tens of thousands of one team's records in a pass; their
    # estimates must not leave the cache in one script that holds Redis for all of them.
    store = RedisStore.from_url(redis_url, timeout=2.0)
    p = KeyCodec("quota", timedelta(days=2)).plan(Identity("acme", "alpha"), utcnow())
    keys = [c.usage_key for c in p.checks[:2]]
    fills = [UsageFill(c.usage_key, 0, c.expires_at) for c in p.checks[:2]]
    await store.fill(p, {}, fills, policy_ttl=60)
    ids = [f"r{i:06d}" for i in range(6_000)]
    for start in range(0, len(ids), 1000):
        async with anyio.create_task_group() as tg:
            for rid in ids[start : start + 1000]:
                tg.start_soon(store.postflight, rid, 1, keys)
    admin = redis.Redis.from_url(redis_url)
    admin.config_set("slowlog-max-len", 100_000)
    admin.config_set("slowlog-log-slower-than", 0)
    admin.slowlog_reset()
    try:
        await store.refresh([RefreshEntry(k, len(ids), tuple(ids)) for k in keys])
        log = admin.slowlog_get(100_000)
    finally:
        admin.config_set("slowlog-log-slower-than", 10_000)
        admin.close()
    assert await store.read_usage(keys) == {k: len(ids) for k in keys}
    assert await store.pending_records(keys) == {}
    await store.aclose()
    # The server logs a script call's first arguments and how many more it had.
    sizes = []
    for e in log:
        if e["command"].split()[0].upper() == b"EVALSHA":
            more = re.search(rb"\.\.\. \((\d+) more arguments\)", e["command"])
            words = len(e["command"].split())
            sizes.append(words - 4 + int(more.group(1)) if more else words)
    assert len(sizes) >= 2 * len(ids) // REFRESH_IDS
    # Each call: the script's sha and key count, its keys and their headers, and its ids.
    assert max(sizes) <= 3 + 5 * len(keys) + REFRESH_IDS, max(sizes)


async def test_readded_policy_does_not_trust_a_stale_usage_key(
    redis_gw: Gateway, redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from spendguard.cli import main as cli_main

    async def main(argv: list[str]) -> int:  # the CLI runs its own event loop: in a thread
        return await anyio.to_thread.run_sync(cli_main, argv)

    monkeypatch.setenv("SPENDGUARD_REDIS_URL", redis_url)
    monkeypatch.setenv(
        "SPENDGUARD_DATABASE_URL", str(redis_gw.settings.database_url.get_secret_value())
    )
    monkeypatch.setenv("SPENDGUARD_PRICES", str(redis_gw.settings.prices))
    day = ["--team", "acme", "--api-key", "alpha", "--period", "day"]
    assert await main(["policy", "set", *day, "--limit-usd", "1"]) == 0
    async with redis_gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        assert await main(["policy", "rm", *day]) == 0
        for _ in range(3):  # spend while no limit applies: the cached key is not updated
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        await redis_gw.settle()
        # Re-add a limit the period's spend (4 x 15) already reaches: denied at once.
        assert await main(["policy", "set", *day, "--limit-usd", "0.00006"]) == 0
        r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 429


async def test_more_requests_in_flight_than_the_pool_wait_instead_of_failing(
    tmp_path: Path, redis_url: str
) -> None:
    store = RedisStore.from_url(redis_url, timeout=2.0, max_connections=8)
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        await gw.policy(Period.DAY, 10**9)
        statuses: list[int] = []  # 64 concurrent requests over 8 connections
        async with gw.client() as c:

            async def one() -> None:
                r = await c.post("/v1/chat/completions", json=chat_body())
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(64):
                    tg.start_soon(one)
        assert statuses == [200] * 64
    await store.aclose()


@pytest.mark.timeout(60)
async def test_a_burst_of_200_on_a_healthy_redis_gets_no_503_and_no_fail_open(
    tmp_path: Path, redis_url: str
) -> None:
    # The acceptance line, with the default timeout and a cold store: the requests
    # queue for the event loop, but what the timeout measures is Redis, which answers at once.
    timeout = Settings.model_fields["redis_timeout"].default
    store = RedisStore.from_url(redis_url, timeout=timeout)
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        await gw.policy(Period.DAY, 10**12)
        refused = metric("spendguard_store_unavailable_total", action="deny")
        admitted = metric("spendguard_store_unavailable_total", action="allow")
        statuses: list[int] = []
        async with gw.client() as c:
            # One request first, as a gateway in service has had: the cache is warm, the
            # burst is all hot path.
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200

            async def one() -> None:
                r = await c.post("/v1/chat/completions", json=chat_body())
                statuses.append(r.status_code)

            for _ in range(2):
                async with anyio.create_task_group() as tg:
                    for _ in range(200):
                        tg.start_soon(one)
        assert statuses == [200] * 400
        assert metric("spendguard_store_unavailable_total", action="deny") == refused
        assert metric("spendguard_store_unavailable_total", action="allow") == admitted
        assert gw.postflights == 401
    await store.aclose()
