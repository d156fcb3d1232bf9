"""The pool store Protocol: one atomic call per decision on one provider key.

Two implementations pass one contract suite (``tests/providers/test_contract.py``): the
embedded :class:`~spendguard.providers.memory.MemoryPoolStore` and the Redis one, where every
method is one Lua script (every provider key's state sits in the pool's one Cluster slot, so
one script chooses among candidates). Time is always the caller's: every call gets ``now``
in epoch milliseconds, so the stores hold no clock and a test drives both with the same frozen time.

The semantics, shared by both:

- A key holds its capacity (``rpm``, ``tpm``; absent: unlimited), the counters of one
  one-minute window (``requests``, ``tokens``, and which window they belong to) and the end of
  its cooldown. Counters of a window that is over read as 0.
- ``acquire`` reserves 1 request and ``tokens`` in the current window on the first candidate,
  in order, that is registered, not cooling down, and where both fit: ``requests + 1 <= rpm``
  and ``tokens_used + tokens <= tpm``. Choice, check and reservation are one step.
- ``settle`` in the lease's window replaces the reservation with the actual tokens (never
  below 0); in a later window it adds only what the call used beyond its reservation, to the
  current window (those tokens reached the provider then). ``release`` (``actual=None``) in
  the lease's window gives back the request and the reserved tokens; later, nothing is left
  to give back.
- ``cooldown`` moves a key's cooldown end to the later of the stored and the given time: a
  replica never shortens a cooldown another set.
- ``register`` sets provider and capacity and keeps the counters and the cooldown, so
  re-registering at start (every replica does) never resets a window.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .model import ProviderKey, Refusal


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Attempt:
    """One candidate's answer to ``acquire``."""

    refusal: Refusal | None  # None: granted
    window: int = 0  # granted: the window the reservation is in
    free_at_ms: int | None = None  # refused: when the key frees (None: never, as it stands)

    @property
    def granted(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key's stored state, counters already read in the window of ``now``."""

    provider: str
    tpm: int | None
    rpm: int | None
    requests: int
    tokens: int
    cooling_until_ms: int  # 0 or a past time: not cooling down


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Acquired:
    """``acquire``'s answer: the candidate granted (its index), or every candidate's refusal."""

    granted: int | None  # index into the candidates; None: none had room
    window: int = 0  # granted: the window the reservation is in
    refused: tuple[Attempt, ...] = ()  # not granted: each candidate's refusal, in order


@runtime_checkable
class PoolStore(Protocol):
    shared: bool  # True when every replica sees the same keys (Redis)

    async def register(self, key: ProviderKey) -> None: ...

    async def remove(self, key_id: str) -> None: ...

    def acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Awaitable[Acquired]:
        """Sent at once (on Redis, in the next pipeline write); await the answer."""
        ...

    def settle(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> Awaitable[object]:
        """Sent at once, like ``acquire``."""
        ...

    async def cooldown(self, key_id: str, until_ms: int) -> int | None:
        """The key's cooldown end after this call; None if the key is not registered."""
        ...

    async def state(self, key_id: str, now_ms: int) -> StoredKey | None: ...

    async def aclose(self) -> None: ...
