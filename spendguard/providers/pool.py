"""The provider-key pool: the supply side of a gateway (which upstream key may take a request).

A router that chooses late makes three calls per request::

    lease = await pool.acquire(["openai-1", "openai-2"], tokens=estimate)  # or NoCapacity
    ...call the provider with lease.key_id's secret...
    await pool.settle(lease, tokens=used)          # after the call
    # on a 429: await pool.cooldown(lease.key_id, retry_after); await pool.release(lease)

A gateway that declares its candidates to the middleware (``provider_candidates``) gets the
lease in the request state instead, acquired in the admission's round trip and settled in the
finishing one (:mod:`spendguard.asgi.admission`).

What is atomic: the choice among the candidates and the reservation on the chosen one are one
store call (one Lua script over the pool's one slot, on Redis), so a key is never
over-reserved and a request gets the first candidate, in order, with room. Settle, release
and cooldown are one call each.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import TypeVar

from ..clock import from_micros, to_micros, utcnow
from ..limits.capacity import WINDOW_MS, Acquired, ProviderKey, Refusal, check_count
from ..settings import Settings, load_settings
from ..store import Store, make_store, store_for
from .model import KeyState, Lease, NoCapacity

T = TypeVar("T")

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
        store: Store,
        *,
        clock: Callable[[], datetime] = utcnow,
        max_cooldown: float = MAX_COOLDOWN,
        owned: bool = True,
    ) -> None:
        if not max_cooldown > 0:
            raise ValueError("max_cooldown must be positive")
        self.store = store
        self._clock = clock
        self._max_cooldown = max_cooldown
        self._owned = owned  # False: the store is a gateway's, closed with its guard

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
        settings = Settings.model_construct(key_prefix=prefix, redis_timeout=timeout)
        return cls(store_for(url, settings, clock), clock=clock)

    @classmethod
    def from_settings(
        cls, settings: Settings | None = None, *, clock: Callable[[], datetime] = utcnow
    ) -> ProviderPool:
        """The pool where spendguard's cache is: on ``SPENDGUARD_REDIS_URL`` (with its key
        prefix and timeout) when it is set, else in this process."""
        settings = settings or load_settings()
        return cls(make_store(settings, clock), clock=clock)

    @classmethod
    def beside(cls, store: Store, *, clock: Callable[[], datetime] = utcnow) -> ProviderPool:
        """The pool in a gateway's own store: on Redis its calls leave in the same pipeline
        writes as the spend limits'; the store stays the gateway's to close."""
        return cls(store, clock=clock, owned=False)

    async def register(self, *keys: ProviderKey) -> None:
        """Add keys, or change their provider and capacity; their counters and cooldowns
        stay, so every replica may register its keys at start."""
        for key in keys:
            await self.store.register_key(key)

    async def remove(self, key_id: str) -> None:
        await self.store.remove_key(key_id)

    async def acquire(self, candidates: Iterable[str | ProviderKey], *, tokens: int) -> Lease:
        """Reserve one request and ``tokens`` on the first candidate, in order, that is
        registered, not cooling down and has room for both in its current minute.

        Raises :class:`NoCapacity` (with when the earliest candidate frees) if none has.
        """
        got = await self.begin(candidates, tokens=tokens)
        if isinstance(got, NoCapacity):
            raise got
        return got

    def begin(
        self, candidates: Iterable[str | ProviderKey], *, tokens: int
    ) -> Awaitable[Lease | NoCapacity]:
        """:meth:`acquire`, its store call sent before this returns (on Redis in the next
        pipeline write, with whatever else this event-loop turn sends); the awaited result
        is the lease or the :class:`NoCapacity` (returned, not raised)."""
        check_count("tokens", tokens, allow_none=False)
        ids = list(dict.fromkeys(c.id if isinstance(c, ProviderKey) else c for c in candidates))
        now = self._clock()
        if not ids:
            return _ready(NoCapacity({}, None, now))
        return self._leased(ids, tokens, now, self.store.acquire(ids, tokens, _ms(now)))

    @staticmethod
    async def _leased(
        ids: list[str], tokens: int, now: datetime, acquiring: Awaitable[Acquired]
    ) -> Lease | NoCapacity:
        got = await acquiring
        if got.granted is not None:
            return Lease(ids[got.granted], got.window, tokens)
        refusals: dict[str, Refusal] = {}
        free_at: int | None = None
        for key_id, attempt in zip(ids, got.refused, strict=True):
            assert attempt.refusal is not None
            refusals[key_id] = attempt.refusal
            frees = attempt.free_at_ms
            if frees is not None:
                free_at = frees if free_at is None else min(free_at, frees)
        return NoCapacity(refusals, None if free_at is None else _time(free_at), now)

    async def settle(self, lease: Lease, *, tokens: int) -> None:
        """True the lease up to the ``tokens`` the call used (prompt and output). A lease is
        settled or released once: a second call does nothing."""
        await self.settle_soon(lease, tokens)

    def settle_soon(self, lease: Lease, tokens: int | None) -> Awaitable[object]:
        """:meth:`settle` (``tokens`` None: :meth:`release`), sent before this returns."""
        if tokens is not None:
            check_count("tokens", tokens, allow_none=False)
        if lease.done:
            return _ready(None)
        lease.done = True
        now_ms = _ms(self._clock())
        return self.store.settle_lease(lease.key_id, lease.window, lease.tokens, tokens, now_ms)

    def settle_later(self, lease: Lease, tokens: int) -> tuple[int, int, int] | None:
        """:meth:`settle`, to be sent with others on the same key by :meth:`settle_together`:
        what to send (None: the lease was finished already); it counts as settled from now
        on."""
        check_count("tokens", tokens, allow_none=False)
        if lease.done:
            return None
        lease.done = True
        return (lease.window, lease.tokens, tokens)

    def settle_together(self, key_id: str, leases: list[tuple[int, int, int]]) -> Awaitable[object]:
        """The settlements :meth:`settle_later` made of leases on ``key_id``, sent now, as one
        call."""
        return self.store.settle_leases(key_id, leases, _ms(self._clock()))

    async def release(self, lease: Lease) -> None:
        """Give the lease back: the call was not made, or the provider refused it."""
        await self.settle_soon(lease, None)

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
        found = await self.store.key_state(key_id, now_ms)
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
        if self._owned:
            await self.store.aclose()


async def _ready(value: T) -> T:
    """An awaitable already answered (nothing to send)."""
    return value


__all__ = ["ProviderPool"]
