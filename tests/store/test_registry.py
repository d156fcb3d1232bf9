"""Tests for spendguard.store (the package): a store is chosen by the scheme of its URL through
one registry; no URL is the embedded store."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import SecretStr

from spendguard import Settings, SpendGuard
from spendguard.errors import ConfigurationError, StoreFull
from spendguard.identity import Identity
from spendguard.limits import KeyCodec, Period, key_limit
from spendguard.store import STORES, MemoryStore, Outcome, RedisStore, Store, UsageFill, make_store
from tests.support import Clock

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
CODEC = KeyCodec("quota", timedelta(days=2))


def settings(tmp_path: Path, redis_url: str | None = None, **fields: object) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", redis_url=redis_url, **fields)


async def test_no_url_is_the_embedded_store_with_its_bound_and_clock(tmp_path: Path) -> None:
    clock = Clock(datetime(2100, 1, 5, tzinfo=UTC))
    store = make_store(settings(tmp_path, memory_max_keys=2), clock)
    assert isinstance(store, MemoryStore) and store.shared is False
    # The store's clock is the one given: a day long past by it is never filled (by the
    # machine's clock that day is still ahead).
    plan = CODEC.plan(ALPHA, datetime(2099, 12, 31, tzinfo=UTC))
    day = plan.find(key_limit(ALPHA, Period.DAY))
    fields = {day.field: 10}
    await store.fill(plan, fields, [UsageFill(day.usage_key, 0, day.expires_at)], policy_ttl=60)
    assert await store.read_usage([day.usage_key]) == {day.usage_key: None}
    # The bound is memory_max_keys: the policy hash and two more keys do not fit in 2.
    now = CODEC.plan(Identity("other", "k"), clock())
    fills = [UsageFill(c.usage_key, 0, c.expires_at) for c in now.checks[:2]]
    with pytest.raises(StoreFull):
        await store.fill(now, {c.field: 10 for c in now.checks[:2]}, fills, policy_ttl=60)


async def test_a_redis_url_is_the_redis_store_talking_to_that_server(
    tmp_path: Path, redis_url: str
) -> None:
    store, other = (
        make_store(settings(tmp_path, redis_url)),
        make_store(settings(tmp_path, redis_url)),
    )
    try:
        assert isinstance(store, RedisStore) and store.shared is True
        plan = CODEC.plan(ALPHA, datetime.now(UTC))
        await store.fill(plan, {}, [], policy_ttl=60)  # "no policy", cached in that server
        assert (await store.preflight(plan)).outcome is Outcome.ALLOW
        assert (await other.preflight(plan)).outcome is Outcome.ALLOW  # shared: seen by others
    finally:
        await store.aclose()
        await other.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "rediss://127.0.0.1:1/0",
        "unix:///nonexistent/redis.sock",
        "redis+cluster://127.0.0.1:1",
        "rediss+cluster://127.0.0.1:1",
    ],
)
async def test_every_redis_scheme_makes_a_redis_store(tmp_path: Path, url: str) -> None:
    store = make_store(settings(tmp_path, url))  # nothing is connected before the first call
    assert isinstance(store, RedisStore) and store.shared
    await store.aclose()


def test_an_unknown_scheme_is_a_configuration_error_naming_it(tmp_path: Path) -> None:
    # Settings refuse such a URL at load; the registry refuses it too when handed one.
    odd = settings(tmp_path).model_copy(update={"redis_url": SecretStr("memcached://cache:11211")})
    with pytest.raises(ConfigurationError, match="'memcached'") as refused:
        make_store(odd)
    assert "redis://" in str(refused.value) and "memory://" in str(refused.value)


def test_the_scheme_is_looked_up_in_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[str, Settings, Callable[[], datetime]]] = []
    clock = Clock()

    def factory(url: str, s: Settings, c: Callable[[], datetime]) -> Store:
        made.append((url, s, c))
        return MemoryStore(clock=c)

    monkeypatch.setitem(STORES, "rediss", factory)
    chosen = settings(tmp_path, "rediss://cache.example:6380/2")
    assert isinstance(make_store(chosen, clock), MemoryStore)
    assert made == [("rediss://cache.example:6380/2", chosen, clock)]
    monkeypatch.delitem(STORES, "rediss")
    with pytest.raises(ConfigurationError, match="'rediss'"):
        make_store(chosen)


async def test_redis_url_switches_the_middleware_store(redis_url: str, tmp_path: Path) -> None:
    guard = SpendGuard(settings(tmp_path, redis_url))
    assert isinstance(guard.store, RedisStore)
    await guard.store.aclose()
    assert isinstance(SpendGuard(settings(tmp_path)).store, MemoryStore)
