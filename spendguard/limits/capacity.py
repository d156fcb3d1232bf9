"""Provider capacity: an upstream key's per-minute limits and what the store answers for it.

A provider key is a subject of the one limit vocabulary (``SubjectKind.PROVIDER_KEY``) with
two limits over the rate window: requests (RPM) and tokens (TPM), counted in fixed windows
aligned on the UTC minute. A provider key here is an *id* the router chooses
(``openai-prod-1``), never the secret: the secret stays in the router's own configuration and
nothing of it reaches the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from .rates import WINDOW_MS  # the rate window: a key counts in fixed UTC minutes

__all__ = [
    "MAX_AMOUNT",
    "WINDOW_MS",
    "Acquired",
    "Attempt",
    "ProviderKey",
    "Refusal",
    "StoredKey",
    "check_count",
]

MAX_AMOUNT: Final = 10**12
"""The largest token count or capacity accepted. It keeps every count and every epoch
millisecond exact in Lua's doubles and in their decimal form (14 significant digits)."""


def check_count(name: str, value: int | None, *, allow_none: bool) -> None:
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
        check_count("tpm", self.tpm, allow_none=True)
        check_count("rpm", self.rpm, allow_none=True)


class Refusal(StrEnum):
    """Why a candidate did not get the request."""

    COOLING = "cooling"  # in a cooldown after the provider answered 429
    FULL = "full"  # no request or not enough tokens left in this window
    TOO_LARGE = "too_large"  # the estimate is more than the key's whole TPM
    UNKNOWN = "unknown"  # not registered


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


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Acquired:
    """``acquire``'s answer: the candidate granted (its index), or every candidate's refusal."""

    granted: int | None  # index into the candidates; None: none had room
    window: int = 0  # granted: the window the reservation is in
    refused: tuple[Attempt, ...] = ()  # not granted: each candidate's refusal, in order


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key's stored state, counters already read in the window of ``now``."""

    provider: str
    tpm: int | None
    rpm: int | None
    requests: int
    tokens: int
    cooling_until_ms: int  # 0 or a past time: not cooling down
