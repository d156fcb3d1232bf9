"""The provider-key pool: supply-side limits for the gateway's router.

Provider keys are registered with their capacity per minute (TPM, RPM); a request acquires a
lease on the first candidate key with room for it (one request and the estimated tokens,
reserved atomically, shared across replicas through Redis), settles or releases it after the
call, and a key the provider answered 429 goes into a cooldown every replica skips.

    pool = ProviderPool.from_settings()      # Redis if SPENDGUARD_REDIS_URL is set
    await pool.register(ProviderKey("openai-1", "openai", tpm=200_000, rpm=500))
    lease = await pool.acquire(["openai-1", "openai-2"], tokens=estimate)
    await pool.settle(lease, tokens=used)    # or: cooldown(lease.key_id, s) + release(lease)

Or declared to the middleware (``provider_candidates``, or ``candidates=``): the lease is then
taken in the admission's round trip and settled in the finishing one, and the app finds it in
``request.state.spendguard_provider_key`` (:data:`STATE_PROVIDER_KEY`).

Modules: :mod:`.model` (values and :class:`NoCapacity`), :mod:`.base` (the store Protocol and
its shared semantics), :mod:`.memory` and :mod:`.redis` (the stores; Lua in ``lua/``),
:mod:`.pool` (the API), :mod:`.routing` (candidates declared at admission),
:mod:`.retry_after` (reading a 429's wait).
"""

from __future__ import annotations

from .base import Attempt, PoolStore, StoredKey
from .memory import MemoryPoolStore
from .model import WINDOW_MS, KeyState, Lease, NoCapacity, ProviderKey, Refusal
from .pool import MAX_COOLDOWN, POOL_STORES, ProviderPool
from .redis import RedisPoolStore
from .retry_after import retry_after_seconds
from .routing import STATE_PROVIDER_KEY, Candidates, ProviderRouting, candidates_of

__all__ = [
    "MAX_COOLDOWN",
    "POOL_STORES",
    "STATE_PROVIDER_KEY",
    "WINDOW_MS",
    "Attempt",
    "Candidates",
    "KeyState",
    "Lease",
    "MemoryPoolStore",
    "NoCapacity",
    "PoolStore",
    "ProviderKey",
    "ProviderPool",
    "ProviderRouting",
    "RedisPoolStore",
    "Refusal",
    "StoredKey",
    "candidates_of",
    "retry_after_seconds",
]
