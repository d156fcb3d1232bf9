"""What only the Redis store's provider capacity has: key names and slots, script reloads,
failures."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.errors import StoreUnavailable
from spendguard.providers import NoCapacity, ProviderKey, ProviderPool, Refusal
from spendguard.store.redis import RedisStore
from tests.support import Clock, RedisCluster, RedisServer, free_port

pytestmark = pytest.mark.anyio

NOW = datetime(2026, 9, 30, 12, 0, 10, tzinfo=UTC)


async def test_keys_share_one_slot_and_one_script_chooses(redis_cluster: RedisCluster) -> None:
    redis_cluster.flushall()
    store = RedisStore.from_url(redis_cluster.url, timeout=2.0)
    pool = ProviderPool(store, clock=Clock(NOW))
    try:
        # As a gateway does at start: another test of this process may have flushed the
        # scripts, and a reload would be one more call than the choice itself.
        await store.load_scripts()
        ids = [f"openai-{i}" for i in range(8)]
        await pool.register(*(ProviderKey(i, "openai", rpm=1) for i in ids))
        names = [store.pool_key(i) for i in ids]
        assert names[0] == "quota:{pool}:openai-0"
        # One hash tag for the whole pool: one slot, so one script sees every candidate.
        assert len({redis_cluster.slot_of(n) for n in names}) == 1
        batches = store.pipeline.stats.batches
        # Each acquire over all eight candidates is one script call: the first with room wins.
        granted = [(await pool.acquire(ids, tokens=1)).key_id for _ in ids]
        assert granted == ids
        assert store.pipeline.stats.batches - batches == len(ids)
        with pytest.raises(NoCapacity) as full:
            await pool.acquire(ids, tokens=1)
        assert set(full.value.refusals.values()) == {Refusal.FULL}
        assert list(full.value.refusals) == ids
    finally:
        await pool.aclose()


async def test_nothing_secret_is_stored(redis_server: RedisServer) -> None:
    pool = ProviderPool(RedisStore.from_url(redis_server.url, timeout=2.0), clock=Clock(NOW))
    try:
        await pool.register(ProviderKey("openai-1", "openai", tpm=10, rpm=5))
        lease = await pool.acquire(["openai-1"], tokens=3)
        await pool.settle(lease, tokens=4)
        await pool.cooldown("openai-1", 1)
        assert redis_server.cli("KEYS", "*").split() == ["quota:{pool}:openai-1"]
        fields = redis_server.cli("HGETALL", "quota:{pool}:openai-1").split()
        assert dict(zip(fields[::2], fields[1::2], strict=True)) == {
            "p": "openai",
            "rpm": "5",
            "tpm": "10",
            "w": str(int(NOW.timestamp()) // 60),
            "r": "1",
            "t": "4",
            "cu": str(int(NOW.timestamp()) * 1000 + 1000),
        }
    finally:
        await pool.aclose()


async def test_scripts_come_back_after_a_script_flush(redis_server: RedisServer) -> None:
    pool = ProviderPool(RedisStore.from_url(redis_server.url, timeout=2.0), clock=Clock(NOW))
    try:
        await pool.register(ProviderKey("a", "openai", rpm=2))
        await pool.acquire(["a"], tokens=1)
        redis_server.cli("SCRIPT", "FLUSH")
        await pool.acquire(["a"], tokens=1)
        state = await pool.state("a")
        assert state is not None and state.requests == 2
    finally:
        await pool.aclose()


async def test_an_unreachable_redis_is_store_unavailable() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    pool = ProviderPool(store, clock=Clock(NOW))
    try:
        with pytest.raises(StoreUnavailable) as failed:
            await pool.acquire(["a"], tokens=1)
        assert failed.value.__cause__ is not None
        with pytest.raises(StoreUnavailable):
            await pool.cooldown("a", 1)
    finally:
        await pool.aclose()


async def test_scripts_refuse_bad_input_as_value_error(redis_url: str) -> None:
    store = RedisStore.from_url(redis_url, timeout=2.0)
    try:
        await store.register_key(ProviderKey("a", "openai"))
        with pytest.raises(ValueError, match="spendguard pool acquire"):
            await store.acquire(["a"], 10**14, 0)  # past what Lua's doubles keep exact
        with pytest.raises(ValueError, match="spendguard pool cooldown"):
            await store.cooldown("a", -1)
    finally:
        await store.aclose()
