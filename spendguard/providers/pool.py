"""The provider-key pool: the supply side of a gateway (which upstream key may take a request).

A router makes three calls per request::

    lease = await pool.acquire(["openai-1", "openai-2"], tokens=estimate)  # or NoCapacity
    ...call the provider with lease.key_id's secret...
    await pool.settle(lease, tokens=used)          # after the call
    # on a 429: await pool.cooldown(lease.key_id, retry_after); await pool.release(lease)

What is atomic: each candidate's check-and-reserve is one store call (one Lua script on its
key's hash, on Redis). Acquire tries the candidates in order, one call each, and stops at the
first that grants, so a key is never over-reserved; the choice across candidates is not one
step (a key refused a moment ago may have freed by the time the next one grants), which costs
at most a less preferred key, never capacity. Settle, release and cooldown are one call each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import datetime

from ..clock import from_micros, to_micros, utcnow
from ..errors import ConfigurationError
from ..settings import Settings, load_settings
from ..store.redis import REDIS_SCHEMES
from .base import PoolStore
from .memory import MemoryPoolStore
from .model import MAX_AMOUNT, WINDOW_MS, KeyState, Lease, NoCapacity, ProviderKey, Refusal
from .redis import RedisPoolStore

PoolStoreFactory = Callable[[str, str, float], PoolStore]


def _memory(url: str, prefix: str, timeout: float) -> PoolStore:
    return MemoryPoolStore()


def _redis(url: str, prefix: str, timeout: float) -> PoolStore:
    return RedisPoolStore.from_url(url, prefix=prefix, timeout=timeout)


POOL_STORES: dict[str, PoolStoreFactory] = {
    "memory": _memory,
    **dict.fromkeys(REDIS_SCHEMES, _redis),
}
"""URL scheme -> pool store (``memory://``: in this process only)."""

MAX_COOLDOWN = 3600.0
"""Seconds a single cooldown may last by default: a provider's absurd Retry-After must not
take a key out of the pool for days."""


def _ms(t: datetime) -> int:
    return to_micros(t) // 1000


def _time(ms: int) -> datetime:
    return from_micros(ms * 1000)


class ProviderPool:
    """Provider keys with per-minute capacity and cooldowns, shared by every replica that
    uses the same store (Redis)."""

    def __init__(
        self,
        store: PoolStore,
        *,
        clock: Callable[[], datetime] = utcnow,
        max_cooldown: float = MAX_COOLDOWN,
    ) -> None:
        if not max_cooldown > 0:
            raise ValueError("max_cooldown must be positive")
        self.store = store
        self._clock = clock
        self._max_cooldown = max_cooldown

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "quota",
        timeout: float = 0.5,
        clock: Callable[[], datetime] = utcnow,
    ) -> ProviderPool:
        """The pool on ``memory://`` or a Redis URL (``redis://``, ``rediss://``, ``unix://``,
        ``redis+cluster://``); ``timeout`` bounds each Redis call."""
        scheme = url.partition("://")[0]
        factory = POOL_STORES.get(scheme)
        if factory is None:
            raise ConfigurationError(
                f"unsupported pool URL scheme {scheme!r}: use one of "
                + ", ".join(f"{s}://" for s in POOL_STORES)
            )
        return cls(factory(url, prefix, timeout), clock=clock)

    @classmethod
    def from_settings(
        cls, settings: Settings | None = None, *, clock: Callable[[], datetime] = utcnow
    ) -> ProviderPool:
        """The pool where spendguard's cache is: on ``SPENDGUARD_REDIS_URL`` (with its key
        prefix and timeout) when it is set, else in this process."""
        settings = settings or load_settings()
        url = "memory://" if settings.redis_url is None else settings.redis_url.get_secret_value()
        return cls.from_url(
            url, prefix=settings.key_prefix, timeout=settings.redis_timeout, clock=clock
        )

    async def register(self, *keys: ProviderKey) -> None:
        """Add keys, or change their provider and capacity; their counters and cooldowns
        stay, so every replica may register its keys at start."""
        for key in keys:
            await self.store.register(key)

    async def remove(self, key_id: str) -> None:
        await self.store.remove(key_id)

    async def acquire(self, candidates: Iterable[str | ProviderKey], *, tokens: int) -> Lease:
        """Reserve one request and ``tokens`` on the first candidate, in order, that is
        registered, not cooling down and has room for both in its current minute.

        Raises :class:`NoCapacity` (with when the earliest candidate frees) if none has.
        """
        _check_tokens(tokens)
        now = self._clock()
        now_ms = _ms(now)
        refusals: dict[str, Refusal] = {}
        free_at: int | None = None
        for candidate in candidates:
            key_id = candidate.id if isinstance(candidate, ProviderKey) else candidate
            if key_id in refusals:
                continue
            attempt = await self.store.acquire(key_id, tokens, now_ms)
            if attempt.refusal is None:
                return Lease(key_id, attempt.window, tokens)
            refusals[key_id] = attempt.refusal
            frees = attempt.free_at_ms
            if frees is not None:
                free_at = frees if free_at is None else min(free_at, frees)
        raise NoCapacity(refusals, None if free_at is None else _time(free_at), now)

    async def settle(self, lease: Lease, *, tokens: int) -> None:
        """True the lease up to the ``tokens`` the call used (prompt and output)."""
        _check_tokens(tokens)
        await self.store.settle(
            lease.key_id, lease.window, lease.tokens, tokens, _ms(self._clock())
        )

    async def release(self, lease: Lease) -> None:
        """Give the lease back: the call was not made, or the provider refused it."""
        await self.store.settle(lease.key_id, lease.window, lease.tokens, None, _ms(self._clock()))

    async def cooldown(self, key_id: str, seconds: float) -> datetime | None:
        """Skip ``key_id`` on every replica for ``seconds`` (e.g. a 429's Retry-After, see
        :func:`retry_after_seconds`), at most ``max_cooldown``. A longer cooldown already set
        stays. Returns when the key's cooldown ends, None if it is not registered."""
        if not isinstance(seconds, int | float) or math.isnan(seconds) or seconds < 0:
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        wait_ms = math.ceil(min(float(seconds), self._max_cooldown) * 1000)
        ends = await self.store.cooldown(key_id, _ms(self._clock()) + wait_ms)
        return None if ends is None else _time(ends)

    async def state(self, key_id: str) -> KeyState | None:
        """What the store holds for ``key_id`` now (None: not registered)."""
        now_ms = _ms(self._clock())
        found = await self.store.state(key_id, now_ms)
        if found is None:
            return None
        return KeyState(
            key_id=key_id,
            provider=found.provider,
            tpm=found.tpm,
            rpm=found.rpm,
            requests=found.requests,
            tokens=found.tokens,
            cooling_until=(
                _time(found.cooling_until_ms) if found.cooling_until_ms > now_ms else None
            ),
            window_ends=_time((now_ms // WINDOW_MS + 1) * WINDOW_MS),
        )

    async def aclose(self) -> None:
        await self.store.aclose()


def _check_tokens(tokens: int) -> None:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= MAX_AMOUNT:
        raise ValueError(f"tokens must be an integer from 0 to {MAX_AMOUNT}, got {tokens!r}")


__all__ = ["POOL_STORES", "ProviderPool"]
