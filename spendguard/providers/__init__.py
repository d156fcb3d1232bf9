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

The keys' state lives in the gateway's one store (:class:`~spendguard.store.Store`, its
provider-capacity calls), beside every other limit. Modules: :mod:`.model` (a lease and
:class:`NoCapacity`), :mod:`.pool` (the API), :mod:`.routing` (candidates declared at
admission), :mod:`.retry_after` (reading a 429's wait).
"""

from __future__ import annotations

from ..limits.capacity import WINDOW_MS, ProviderKey, Refusal
from .model import KeyState, Lease, NoCapacity
from .pool import MAX_COOLDOWN, ProviderPool
from .retry_after import retry_after_seconds
from .routing import STATE_PROVIDER_KEY, Candidates, ProviderRouting, candidates_of

__all__ = [
    "MAX_COOLDOWN",
    "STATE_PROVIDER_KEY",
    "WINDOW_MS",
    "Candidates",
    "KeyState",
    "Lease",
    "NoCapacity",
    "ProviderKey",
    "ProviderPool",
    "ProviderRouting",
    "Refusal",
    "candidates_of",
    "retry_after_seconds",
]
