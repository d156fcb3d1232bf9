"""The Redis store's hot path shares round trips: concurrent calls leave as one pipeline.

Against real redis-server processes: coalescing (the pipeline's own count, and what the server
saw), one reply or one error per caller, NOSCRIPT recovery after SCRIPT FLUSH and a restart, a
hung or dead server within the bound, the batch and queue bounds, a burst on a healthy server,
and the cluster. On asyncio's event loop and on uvloop: the batches are written, timed and
answered through the loop's own transports and timers.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from spendguard import Identity
from spendguard.clock import utcnow
from spendguard.errors import StoreUnavailable
from spendguard.limits import KeyCodec, KeyPlan, Limit, Period
from spendguard.limits.codec import field_of
from spendguard.settings import Settings
from spendguard.store import Outcome, UsageFill
from spendguard.store.redis import RedisStore
from tests.support import Gateway, RedisCluster, RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]

CODEC = KeyCodec("quota", timedelta(days=2))
LIMIT = 10**12


def plan(team: str, key: str = "k") -> KeyPlan:
    return CODEC.plan(Identity(team, key), datetime.now(UTC))


async def warm(store: RedisStore, p: KeyPlan, settled: int = 0) -> None:
    """Every limit of ``p`` gets a policy and a usage key holding ``settled`` (no balance)."""
    fields = {field_of(c.target): LIMIT for c in p.checks if isinstance(c.target, Limit)}
    usage = [UsageFill(c.usage_key, settled, c.expires_at) for c in p.checks]
    await store.fill(p, fields, usage, policy_ttl=60)


def commands(server: RedisServer) -> dict[str, int]:
    stats = server.cli("INFO", "commandstats")
    return {m[0]: int(m[1]) for m in re.findall(r"cmdstat_([a-z|]+):calls=(\d+)", stats)}


def evalsha_connections(server: RedisServer) -> int:
    return sum("cmd=evalsha" in line for line in server.cli("CLIENT", "LIST").splitlines())


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(redis_url, timeout=2.0)
    await s.start()
    try:
        yield s
    finally:
        await s.aclose()


async def test_concurrent_calls_share_one_round_trip(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=2.0)
    await store.start()  # loads the scripts: no first-use NOSCRIPT below
    plans = [plan(f"team{i}") for i in range(100)]
    for i, p in enumerate(plans):
        await warm(store, p, settled=i)
    redis_server.cli("CONFIG", "RESETSTAT")
    before = store.pipeline.stats.batches
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    # One pipeline carried all hundred, on one connection; the server ran each script once.
    assert store.pipeline.stats.batches - before == 1
    assert store.pipeline.stats.largest == 100
    assert commands(redis_server)["evalsha"] == 100
    assert evalsha_connections(redis_server) == 1
    # Each caller got its own reply: team i's usage is i.
    for i, pf in enumerate(results):
        assert pf.outcome is Outcome.ALLOW
        assert {state.used for state in pf.limits} == {i}
    await store.aclose()


async def test_calls_made_while_a_batch_is_in_flight_form_the_next_one(
    redis_url: str,
) -> None:
    store = RedisStore.from_url(redis_url, timeout=2.0, max_in_flight=1)
    await store.start()
    p = plan("acme")
    await warm(store, p)
    keys = [c.usage_key for c in p.checks]
    before = store.pipeline.stats.batches

    async def later(i: int) -> int:
        await asyncio.sleep(0)  # a later loop turn: the first batch is on its way by then
        return await store.postflight(f"r{i}", 1, keys)

    applied = await asyncio.gather(store.postflight("r-first", 1, keys), *map(later, range(50)))
    assert applied == [len(keys)] * 51
    assert store.pipeline.stats.batches - before == 2  # the first call, then the other 50
    assert (await store.read_usage(keys[:1]))[keys[0]] == 51
    await store.aclose()


async def test_callers_that_call_again_at_once_keep_being_served(redis_url: str) -> None:
    # The callers a batch wakes up call again before its sender has finished: their calls
    # must start the next sender, not wait for one that is already done.
    store = RedisStore.from_url(redis_url, timeout=2.0, max_in_flight=1)
    p = plan("acme")
    await warm(store, p)

    async def worker() -> None:
        for _ in range(20):
            assert (await store.preflight(p)).outcome is Outcome.ALLOW

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(8))), timeout=10)
    await store.aclose()


@pytest.mark.parametrize(("max_in_flight", "max_batch"), [(1, 1), (1, 3), (2, 256), (4, 5)])
async def test_callers_at_random_moments_are_all_served_once(
    redis_url: str, max_in_flight: int, max_batch: int
) -> None:
    store = RedisStore.from_url(
        redis_url, timeout=2.0, max_in_flight=max_in_flight, max_batch=max_batch
    )
    p = plan("acme")
    await warm(store, p)
    keys = [c.usage_key for c in p.checks]
    rng = random.Random(max_in_flight * 1000 + max_batch)

    async def worker(w: int) -> int:
        applied = 0
        for i in range(15):
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)  # arrive in some later loop turn
            if rng.random() < 0.5:
                assert (await store.preflight(p)).outcome is Outcome.ALLOW
            else:
                applied += await store.postflight(f"w{w}-{i}", 1, keys)
        return applied

    applied = await asyncio.wait_for(asyncio.gather(*map(worker, range(30))), timeout=20)
    total = sum(applied) // len(keys)
    assert (await store.read_usage(keys))[keys[0]] == total
    assert store.pipeline.stats.largest <= max_batch
    await store.aclose()


async def test_a_refused_call_fails_alone(store: RedisStore, shared_redis: RedisServer) -> None:
    good, wrong = plan("good"), plan("wrong-type")
    await warm(store, good)
    await warm(store, wrong)
    keys = [c.usage_key for c in good.checks]
    # A string where the script reads a hash: Redis's own error reply, for that call only.
    shared_redis.cli("SET", wrong.checks[0].usage_key, "not a hash")
    before = store.pipeline.stats.batches
    results = await asyncio.gather(
        store.postflight("ok-1", 5, keys),
        store.postflight("bad id!", 5, keys),  # the script refuses the record id
        store.preflight(wrong),
        store.preflight(good),
        store.postflight("ok-2", 5, keys),
        return_exceptions=True,
    )
    assert store.pipeline.stats.batches - before == 1  # all five in one pipeline
    first, refused, broken, checked, last = results
    assert first == len(keys) and last == len(keys)
    assert isinstance(refused, ValueError) and "bad record id" in str(refused)
    assert isinstance(broken, StoreUnavailable) and "WRONGTYPE" in str(broken)
    assert not isinstance(checked, BaseException) and checked.outcome is Outcome.ALLOW
    assert (await store.read_usage(keys))[keys[0]] == 10  # the two good ones, nothing else


async def test_script_flush_reloads_and_resends_only_the_lost_calls(
    redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=2.0)
    plans = [plan(f"t{i}") for i in range(20)]
    for p in plans:
        await warm(store, p)
    redis_server.cli("SCRIPT", "FLUSH")
    redis_server.cli("CONFIG", "RESETSTAT")
    before = store.pipeline.stats.batches
    keys = [c.usage_key for c in plans[0].checks]
    results = await asyncio.gather(
        *(store.preflight(p) for p in plans), store.postflight("r1", 7, keys)
    )
    assert all(pf.outcome is Outcome.ALLOW for pf in results[:-1])
    assert results[-1] == len(keys)
    # The batch, then the same calls again after loading the two scripts they use.
    assert store.pipeline.stats.batches - before == 2
    seen = commands(redis_server)
    assert seen["script|load"] == 2 and seen["evalsha"] == 2 * 21
    assert (await store.read_usage(keys))[keys[0]] == 7  # applied once
    await store.aclose()


async def test_a_restarted_server_is_used_again_transparently(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=1.0)
    plans = [plan(f"t{i}") for i in range(20)]
    for p in plans:
        await warm(store, p)
    redis_server.restart()  # no keys, no scripts, and the store's sockets are dead
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    assert all(pf.outcome is Outcome.MISS and pf.missing_policy for pf in results)
    for p in plans:
        await warm(store, p)
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    assert all(pf.outcome is Outcome.ALLOW for pf in results)
    await store.aclose()


async def test_a_hung_server_fails_every_caller_within_the_bound(
    redis_server: RedisServer,
) -> None:
    timeout = 0.2
    store = RedisStore.from_url(redis_server.url, timeout=timeout)
    p = plan("acme")
    await warm(store, p)
    redis_server.pause()
    try:
        started = time.monotonic()
        results = await asyncio.gather(
            *(store.preflight(p) for _ in range(50)), return_exceptions=True
        )
        elapsed = time.monotonic() - started
    finally:
        redis_server.resume()
    assert all(isinstance(r, StoreUnavailable) for r in results)
    assert elapsed < 2 * timeout + 0.5  # generous for a loaded machine; the hang is endless
    # The timed-out connection is not reused half-read: the next calls get their own replies.
    after = await asyncio.gather(*(store.preflight(p) for _ in range(5)))
    assert all(pf.outcome is Outcome.ALLOW for pf in after)
    await store.aclose()


async def test_calls_queued_behind_a_hung_server_do_not_wait_for_their_turn(
    redis_server: RedisServer,
) -> None:
    # One batch of two at a time: without the queue bound the fortieth call would wait for
    # twenty timeouts in a row.
    timeout = 0.2
    store = RedisStore.from_url(redis_server.url, timeout=timeout, max_batch=2, max_in_flight=1)
    p = plan("acme")
    await warm(store, p)
    redis_server.pause()
    try:
        started = time.monotonic()
        results = await asyncio.gather(
            *(store.preflight(p) for _ in range(40)), return_exceptions=True
        )
        elapsed = time.monotonic() - started
    finally:
        redis_server.resume()
    assert all(isinstance(r, StoreUnavailable) for r in results)
    assert sum("batch ahead of this call failed" in str(r) for r in results) == 38
    assert elapsed < 2 * timeout + 0.5
    await store.aclose()


async def test_time_spent_waiting_for_the_event_loop_is_not_counted(redis_url: str) -> None:
    store = RedisStore.from_url(redis_url, timeout=0.05)
    await store.start()
    p = plan("acme")
    await warm(store, p)
    calls = [asyncio.ensure_future(store.preflight(p)) for _ in range(50)]
    await asyncio.sleep(0)  # every call is queued; their batch has not been sent yet
    time.sleep(0.2)  # noqa: ASYNC251 - the event loop is stuck in other code for 4 timeouts
    results = await asyncio.gather(*calls)
    # Redis answered at once when asked: no caller is told it is unavailable.
    assert all(pf.outcome is Outcome.ALLOW for pf in results)
    await store.aclose()


async def test_a_dead_server_fails_at_once_and_a_new_one_is_used(
    redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=1.0)
    p = plan("acme")
    await warm(store, p)
    redis_server.kill()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await store.preflight(p)
    assert time.monotonic() - started < 1.0  # refused, not timed out
    redis_server.start()
    assert (await store.preflight(p)).outcome is Outcome.MISS  # an empty server, reachable
    await store.aclose()


async def test_batches_are_bounded(redis_url: str) -> None:
    store = RedisStore.from_url(redis_url, timeout=2.0, max_batch=8)
    await store.start()
    plans = [plan(f"t{i}") for i in range(50)]
    for p in plans:
        await warm(store, p)
    before = store.pipeline.stats.batches
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    assert all(pf.outcome is Outcome.ALLOW for pf in results)
    assert store.pipeline.stats.largest == 8
    assert store.pipeline.stats.batches - before == 7  # ceil(50 / 8)
    await store.aclose()


async def test_warm_calls_on_one_server_start_no_task(store: RedisStore) -> None:
    # On an open connection a batch is written from a loop callback, its replies resolve the
    # callers as they are read and a timer is its deadline: no task per batch (a task cost
    # about as much CPU as the rest of the client path at one request at a time).
    p = plan("acme")
    await warm(store, p)  # the connection is open from here on
    loop = asyncio.get_running_loop()
    made: list[object] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    batches = store.pipeline.stats.batches
    loop.set_task_factory(counting)
    try:
        for _ in range(20):
            assert (await store.preflight(p)).outcome is Outcome.ALLOW
    finally:
        loop.set_task_factory(factory)
    assert store.pipeline.stats.batches - batches == 20  # one round trip each, all sent
    assert made == []


async def test_a_call_whose_caller_gave_up_is_not_sent(store: RedisStore) -> None:
    p = plan("acme")
    await warm(store, p)
    keys = [c.usage_key for c in p.checks]
    sent = store.pipeline.stats.calls
    task = asyncio.ensure_future(store.postflight("gone", 5, keys))
    await asyncio.sleep(0)  # queued, not yet sent
    task.cancel()
    assert await store.postflight("kept", 1, keys) == len(keys)
    assert store.pipeline.stats.calls - sent == 1
    assert (await store.read_usage(keys))[keys[0]] == 1


def test_one_store_in_one_event_loop_after_another(redis_url: str) -> None:
    # A sender or a connection of a finished loop must not hold up the next loop's calls.
    store = RedisStore.from_url(redis_url, timeout=2.0)
    p = plan("acme")

    async def use() -> Outcome:
        await warm(store, p)
        return (await store.preflight(p)).outcome

    assert asyncio.run(use()) is Outcome.ALLOW
    assert asyncio.run(use()) is Outcome.ALLOW


@pytest.mark.timeout(60)
async def test_a_burst_on_a_healthy_server_is_never_unavailable(redis_url: str) -> None:
    # The default timeout, a cold store (no connection open yet) and 200 requests at once,
    # each a preflight then a postflight: Redis answers in microseconds, so not one of them
    # may be reported unavailable however long the event loop makes them queue, in three
    # rounds during which the process itself was not starved of CPU.
    timeout = Settings.model_fields["redis_timeout"].default
    assert timeout == 0.25
    p = plan("burst")
    store = RedisStore.from_url(redis_url, timeout=timeout)
    await warm(store, p)
    await store.aclose()
    keys = [c.usage_key for c in p.checks]
    failures: list[BaseException] = []

    async def one(store: RedisStore, record_id: str, failed: list[BaseException]) -> None:
        try:
            assert (await store.preflight(p)).outcome is Outcome.ALLOW
            await store.postflight(record_id, 1, keys)
        except StoreUnavailable as exc:
            failed.append(exc)

    async def lag(done: asyncio.Event, worst: list[float]) -> None:
        # How long this process went without running its event loop: the timeout counts the
        # round trip with its queueing, so a process the machine starves for longer than the
        # timeout (another test suite's process on the other core) times out by design.
        loop = asyncio.get_running_loop()
        while not done.is_set():
            start = loop.time()
            await asyncio.sleep(0.005)
            worst[0] = max(worst[0], loop.time() - start - 0.005)

    conclusive = 0
    for round_ in range(8):
        store = RedisStore.from_url(redis_url, timeout=timeout)
        done, worst, failed = asyncio.Event(), [0.0], []
        monitor = asyncio.create_task(lag(done, worst))
        await asyncio.gather(*(one(store, f"r{round_}-{i}", failed) for i in range(200)))
        done.set()
        await monitor
        await store.aclose()
        if worst[0] < timeout / 2:  # the process ran: any failure is the store's
            failures += failed
            conclusive += 1
            if conclusive == 3:
                break
    assert conclusive >= 1, "the machine starved this process in every round"
    assert failures == []


async def test_cluster_batches_per_node_and_recovers_lost_scripts(
    redis_cluster: RedisCluster,
) -> None:
    redis_cluster.flushall()
    store = RedisStore.from_url(redis_cluster.url, timeout=2.0)
    await store.start()
    plans = [plan(f"team{i}") for i in range(30)]
    nodes = {redis_cluster.slot_of(p.policy_key) * 3 // 16384 for p in plans}
    assert len(nodes) > 1  # the teams are spread over the masters
    for i, p in enumerate(plans):
        await warm(store, p, settled=i)
    for server in redis_cluster.servers:
        server.cli("SCRIPT", "FLUSH")
    before = store.pipeline.stats.batches
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    assert [{s.used for s in pf.limits} for pf in results] == [{i} for i in range(30)]
    # The batch (its parts to the nodes in parallel), then each node's part once more after
    # the reload.
    assert store.pipeline.stats.batches - before == 1 + len(nodes)
    await store.aclose()


async def test_cluster_calls_on_broken_node_connections_are_sent_again(
    redis_cluster: RedisCluster,
) -> None:
    redis_cluster.flushall()
    store = RedisStore.from_url(redis_cluster.url, timeout=2.0)
    await store.start()
    plans = [plan(f"team{i}") for i in range(30)]
    for p in plans:
        await warm(store, p)
    for server in redis_cluster.servers:
        server.cli("CLIENT", "KILL", "TYPE", "normal")  # every client connection drops
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    assert all(pf.outcome is Outcome.ALLOW for pf in results)
    await store.aclose()


async def test_dropped_connections_are_replaced_without_failing_a_call(
    redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=2.0)
    await store.start()
    plans = [plan(f"team{i}") for i in range(30)]
    for p in plans:
        await warm(store, p)
    redis_server.cli("CLIENT", "KILL", "TYPE", "normal")
    results = await asyncio.gather(*(store.preflight(p) for p in plans))
    assert all(pf.outcome is Outcome.ALLOW for pf in results)
    await store.aclose()


async def test_a_warm_inference_is_two_script_calls_and_nothing_else(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The hot path on Redis, through the whole middleware: one preflight and one postflight
    EVALSHA per inference once the cache is warm, concurrent or not. (Redis also counts the
    commands the scripts run inside; no command is sent besides the scripts.)"""
    store = RedisStore.from_url(redis_server.url, timeout=2.0)
    try:
        async with Gateway(tmp_path, utcnow, store=store) as gw:
            await gw.policy(Period.DAY, 10**9)
            assert (await gw.post()).status_code == 200  # warms policy and usage keys
            redis_server.cli("CONFIG", "RESETSTAT")
            statuses: list[int] = []

            async def one() -> None:
                statuses.append((await gw.post()).status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(one)
            assert statuses == [200] * 20
            for _ in range(5):
                assert (await gw.post()).status_code == 200
        seen = commands(redis_server)
        assert seen["evalsha"] == 2 * 25
        inside_scripts = {"exists", "hexists", "hsetnx", "hincrby", "hmget", "hget", "type"}
        inside_scripts |= {"hgetall", "time", "pexpireat", "hset", "config|resetstat"}
        # Besides the scripts: admission entries leave by record batch (one HDEL per batch,
        # not per inference), the heartbeat, and the alive mark removed at stop.
        assert 1 <= seen.get("hdel", 0) < 25, seen
        besides = {"hdel", "set", "sadd", "del"}
        assert set(seen) - {"evalsha"} <= inside_scripts | besides, seen
        assert redis_server.cli("KEYS", "*:spend:open").strip() == ""  # every entry closed
    finally:
        await store.aclose()


async def test_cluster_calls_to_a_moved_slot_follow_the_redirection() -> None:
    """A slot moves to another master (a resharding) after the client read the slot map: the
    node that no longer has it answers MOVED, and the call goes again through redis-py's
    cluster client, which follows it and refreshes its map; later calls go straight to the new
    node. Nothing fails."""
    with RedisCluster() as cluster:
        store = RedisStore.from_url(cluster.url, timeout=2.0)
        await store.start()
        p = plan("moving")
        await warm(store, p, settled=7)
        slot = cluster.slot_of(p.policy_key)
        ids = {s.port: s.cli("CLUSTER", "MYID").strip() for s in cluster.servers}
        owner = next(
            s
            for s in cluster.servers
            if s.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot)).strip() != "0"
        )
        target = next(s for s in cluster.servers if s is not owner)
        # Move the slot with its keys, as redis-cli --cluster reshard does.
        target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[owner.port])
        owner.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target.port])
        keys = owner.cli("CLUSTER", "GETKEYSINSLOT", str(slot), "100").split()
        owner.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys)
        for server in cluster.servers:
            server.cli("CLUSTER", "SETSLOT", str(slot), "NODE", ids[target.port])
        for _ in range(3):
            pf = await store.preflight(p)
            assert pf.outcome is Outcome.ALLOW and {s.used for s in pf.limits} == {7}
        # The calls went on the pipeline's own node connections, the new owner's included.
        transport: Any = store.pipeline._transport
        assert ("127.0.0.1", target.port) in transport._nodes
        await store.aclose()
