"""The Redis pool store: every call is one Lua script on one provider key's hash.

Each key's state is one hash, ``{prefix}:pool:{<encoded id>}``: the id (never a secret) is the
hash tag, so on Redis Cluster every key lives in a slot of its own and every script touches one
slot. Scripts live in ``lua/*.lua``, are registered once per client and reloaded after
NOSCRIPT by redis-py. Errors become :class:`~spendguard.errors.StoreUnavailable` (Redis could
not decide) or ``ValueError`` (a script refused its input), each keeping its cause.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ..identity import encode_id
from ..store.pipeline import bounded_call
from ..store.redis import client_for as store_client_for
from .base import Attempt, StoredKey
from .model import WINDOW_MS, ProviderKey, Refusal

T = TypeVar("T")
_SCRIPTS = ("register", "acquire", "settle", "cooldown")
# acquire.lua's answer codes.
_REFUSALS = {0: Refusal.UNKNOWN, 2: Refusal.COOLING, 3: Refusal.FULL, 4: Refusal.TOO_LARGE}


def _lua(name: str) -> str:
    return (resources.files("spendguard.providers") / "lua" / f"{name}.lua").read_text("utf-8")


def client_for(url: str, timeout: float) -> aioredis.Redis | RedisCluster:
    """The spend limits' client builder (same schemes, same bounded timeouts), with a pool
    of its own."""
    return store_client_for(url, timeout, max_connections=256)


class RedisPoolStore:
    shared = True  # every replica sees the same counters and cooldowns

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str = "quota",
        timeout: float = 0.5,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._timeout = timeout
        self._scripts = {name: client.register_script(_lua(name)) for name in _SCRIPTS}

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "quota", timeout: float = 0.5) -> RedisPoolStore:
        return cls(client_for(url, timeout), prefix=prefix, timeout=timeout)

    def key_name(self, key_id: str) -> str:
        """The hash holding ``key_id``'s state; its hash tag is the encoded id."""
        return f"{self._prefix}:pool:{{{encode_id(key_id)}}}"

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await bounded_call(fn, self._timeout)

    async def _script(self, name: str, key_id: str, args: Sequence[str]) -> Any:
        script, keys = self._scripts[name], [self.key_name(key_id)]
        return await self._call(lambda: script(keys=keys, args=list(args)))

    async def register(self, key: ProviderKey) -> None:
        await self._script("register", key.id, [key.provider, _opt(key.rpm), _opt(key.tpm)])

    async def remove(self, key_id: str) -> None:
        name = self.key_name(key_id)
        await self._call(lambda: self._client.delete(name))

    async def acquire(self, key_id: str, tokens: int, now_ms: int) -> Attempt:
        code, n = await self._script("acquire", key_id, [str(now_ms), str(tokens), str(WINDOW_MS)])
        code, n = int(code), int(n)
        if code == 1:
            return Attempt(None, window=n)
        refusal = _REFUSALS[code]
        frees = refusal in (Refusal.COOLING, Refusal.FULL)
        return Attempt(refusal, free_at_ms=n if frees else None)

    async def settle(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> None:
        used = "-" if actual is None else str(actual)
        args = [str(window), str(reserved), used, str(now_ms), str(WINDOW_MS)]
        await self._script("settle", key_id, args)

    async def cooldown(self, key_id: str, until_ms: int) -> int | None:
        ends = int(await self._script("cooldown", key_id, [str(until_ms)]))
        return None if ends < 0 else ends

    async def state(self, key_id: str, now_ms: int) -> StoredKey | None:
        name = self.key_name(key_id)
        fields = ["p", "tpm", "rpm", "w", "r", "t", "cu"]
        p, tpm, rpm, w, r, t, cu = await self._call(lambda: self._client.hmget(name, fields))
        if p is None:
            return None
        live = w is not None and int(w) == now_ms // WINDOW_MS
        return StoredKey(
            str(p),
            None if tpm is None else int(tpm),
            None if rpm is None else int(rpm),
            int(r or 0) if live else 0,
            int(t or 0) if live else 0,
            int(cu or 0),
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
