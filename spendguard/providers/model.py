"""The provider-key pool's values for a router: a lease on a key, what a key looks like now,
and why none of the candidates could take a request (the key and its capacity are limit
values: :mod:`spendguard.limits.capacity`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from ..errors import SpendGuardError
from ..limits.capacity import MAX_AMOUNT, WINDOW_MS, ProviderKey, Refusal


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Lease:
    """One request's reservation on a key: one request and ``tokens`` in ``window``.

    Settle it (true up to the tokens the call used) or release it (the call was not made, or
    the provider refused it) exactly once.
    """

    key_id: str
    window: int  # index of the one-minute window the reservation was made in
    tokens: int  # tokens reserved
    done: bool = field(default=False, compare=False)  # settled or released

    @property
    def window_start(self) -> int:
        return self.window * WINDOW_MS


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class KeyState:
    """A key as the store holds it now (counters of the current window)."""

    key_id: str
    provider: str
    tpm: int | None
    rpm: int | None
    requests: int
    tokens: int
    cooling_until: datetime | None  # None: not cooling down
    window_ends: datetime


class NoCapacity(SpendGuardError):
    """No candidate could take the request. ``retry_at`` is when the earliest of them frees
    (a cooldown ends or a full window closes), ``None`` when none ever can (unknown keys, or an
    estimate larger than every key's TPM); ``refusals`` says why each candidate refused."""

    def __init__(
        self, refusals: Mapping[str, Refusal], retry_at: datetime | None, now: datetime
    ) -> None:
        self.refusals = dict(refusals)
        self.retry_at = retry_at
        # Seconds from when it was raised, rounded up: what a Retry-After header says.
        self.retry_after: int | None = None
        if retry_at is not None:
            wait = (retry_at - now).total_seconds()
            self.retry_after = max(1, -int(-wait // 1))
        reasons = ", ".join(f"{k}: {r.value}" for k, r in self.refusals.items()) or "none"
        super().__init__(f"no provider key has capacity ({reasons})")


__all__ = ["MAX_AMOUNT", "WINDOW_MS", "KeyState", "Lease", "NoCapacity", "ProviderKey", "Refusal"]
