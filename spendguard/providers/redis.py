"""The Redis pool store: every call is one Lua script.

Each key's state is one hash, ``{prefix}:{pool}:<encoded id>`` (the id, never a secret). Every
provider key shares the ``{pool}`` hash tag, so on Redis Cluster they live in one slot and one
script chooses among a request's candidates and reserves on the first with room, atomically
(design.md, "One hot slot" says what bounds that slot). Scripts live in ``lua/*.lua``.
``acquire`` and ``settle``, the request path's calls, go through a script pipeline: the
spend store's when given, so they leave in the same write as its preflight and postflight.
Errors become :class:`~spendguard.errors.StoreUnavailable` (Redis could not decide) or
``ValueError`` (a script refused its input), each keeping its cause.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ..identity import encode_id
from ..store.pipeline import ScriptPipeline, bounded_call
from ..store.redis import client_for
from .base import Acquired, Attempt, StoredKey
from .model import WINDOW_MS, ProviderKey, Refusal

T = TypeVar("T")
_SCRIPTS = ("register", "acquire", "settle", "cooldown")
# acquire.lua's answer codes.
_REFUSALS = {0: Refusal.UNKNOWN, 2: Refusal.COOLING, 3: Refusal.FULL, 4: Refusal.TOO_LARGE}


def _lua(name: str) -> str:
    return (resources.files("spendguard.providers") / "lua" / f"{name}.lua").read_text("utf-8")


class RedisPoolStore:
    shared = True  # every replica sees the same counters and cooldowns

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str = "quota",
        timeout: float = 0.5,
        pipeline: ScriptPipeline | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._timeout = timeout
        self._scripts = {name: client.register_script(_lua(name)) for name in _SCRIPTS}
        # The spend store's pipeline (and client) when given: then theirs to close.
        self._owned = pipeline is None
        self.pipeline = pipeline or ScriptPipeline(client, timeout=timeout)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "quota", timeout: float = 0.5) -> RedisPoolStore:
        return cls(client_for(url, timeout, max_connections=256), prefix=prefix, timeout=timeout)

    def key_name(self, key_id: str) -> str:
        """The hash holding ``key_id``'s state, in the pool's one slot."""
        return f"{self._prefix}:{{pool}}:{encode_id(key_id)}"

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

    def acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Awaitable[Acquired]:
        keys = [self.key_name(k) for k in key_ids]
        args = [str(now_ms), str(tokens), str(WINDOW_MS)]
        return self._acquired(self.pipeline.submit(self._scripts["acquire"], keys, args))

    @staticmethod
    async def _acquired(reply: Awaitable[Any]) -> Acquired:
        raw = [int(x) for x in await reply]
        if raw[0] == 1:
            return Acquired(raw[1] - 1, raw[2])
        refused = []
        for code, n in zip(raw[1::2], raw[2::2], strict=True):
            refusal = _REFUSALS[code]
            frees = refusal in (Refusal.COOLING, Refusal.FULL)
            refused.append(Attempt(refusal, free_at_ms=n if frees else None))
        return Acquired(None, refused=tuple(refused))

    def settle(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> Awaitable[object]:
        used = "-" if actual is None else str(actual)
        args = [str(window), str(reserved), used, str(now_ms), str(WINDOW_MS)]
        keys = [self.key_name(key_id)]
        return self.pipeline.submit(self._scripts["settle"], keys, args)

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
        if self._owned:
            await self.pipeline.aclose()
            await self._client.aclose()


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
