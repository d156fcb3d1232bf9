"""How a pool is built: the URL-scheme registry and spendguard's settings."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from spendguard import ConfigurationError, Settings
from spendguard.providers import ProviderPool
from spendguard.store.memory import MemoryStore
from spendguard.store.redis import RedisStore

pytestmark = pytest.mark.anyio


async def test_without_a_redis_url_the_pool_is_in_process() -> None:
    pool = ProviderPool.from_settings(Settings())
    assert isinstance(pool.store, MemoryStore)
    assert isinstance(ProviderPool.from_url("memory://").store, MemoryStore)


async def test_the_pool_follows_spendguards_redis_url_and_prefix() -> None:
    settings = Settings(redis_url=SecretStr("redis://127.0.0.1:1/0"), key_prefix="gw")
    pool = ProviderPool.from_settings(settings)
    try:
        assert isinstance(pool.store, RedisStore)
        assert pool.store.pool_key("openai-1") == "gw:{pool}:openai-1"
    finally:
        await pool.aclose()


@pytest.mark.parametrize("url", ["http://x", "nonsense", "postgresql://db/x"])
def test_an_unknown_scheme_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        ProviderPool.from_url(url)
