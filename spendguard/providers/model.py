"""The provider-key pool's values: a key's capacity, a lease on it, what a key looks like now,
and why none of the candidates could take a request.

A provider key here is an *id* the router chooses (``openai-prod-1``), never the secret: the
secret stays in the router's own configuration and nothing of it reaches the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from ..errors import SpendGuardError

WINDOW_MS = 60_000
"""TPM and RPM are per minute: each key counts in fixed windows aligned on the UTC minute."""

MAX_AMOUNT = 10**12
"""The largest token count or capacity accepted. It keeps every count and every epoch
millisecond exact in Lua's doubles and in their decimal form (14 significant digits)."""


def _check_count(name: str, value: int | None, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_AMOUNT:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_AMOUNT}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ProviderKey:
    """One upstream API key as the pool knows it: its id, the provider it belongs to and its
    capacity per minute. ``None`` leaves a dimension unlimited (it is still counted)."""

    id: str
    provider: str
    tpm: int | None = None
    rpm: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("a provider key needs a non-empty id")
        if not isinstance(self.provider, str) or not self.provider:
            raise ValueError("a provider key needs a non-empty provider name")
        _check_count("tpm", self.tpm, allow_none=True)
        _check_count("rpm", self.rpm, allow_none=True)


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


class Refusal(StrEnum):
    """Why a candidate did not get the request."""

    COOLING = "cooling"  # in a cooldown after the provider answered 429
    FULL = "full"  # no request or not enough tokens left in this window
    TOO_LARGE = "too_large"  # the estimate is more than the key's whole TPM
    UNKNOWN = "unknown"  # not registered


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
