"""Remaining-spend headers: what the caller's own API key may still spend (opt-in).

With ``SPENDGUARD_REMAINING_HEADERS=true`` every answer to a checked inference (the provider's
response and spendguard's own 429) carries, for each window in which the caller's key has a
limit::

    x-spendguard-limit-usd-day: 5.000000
    x-spendguard-remaining-usd-day: 3.217400
    x-spendguard-reset-day: 2026-12-02T00:00:00Z

(and the same with ``-month``). The values are the preflight's: the key's usage before this
inference was charged, read in the same store call that admitted it, so nothing extra is asked
of the store. Team limits and the team's balance are not shown: a key's holder is told about
its own limits only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ..engine.decision import Decision
from ..limits import Limit
from .ratelimit import own_key_limits, ratelimit_fields

__all__ = ["OwnHeaders", "own_headers", "remaining_headers"]

# The headers that tell a caller about its own limits, from the preflight's decision.
OwnHeaders = Callable[[Decision], list[tuple[bytes, bytes]]]


def own_headers(remaining: bool, fields: bool) -> OwnHeaders | None:
    """What the settings add to every answer about the caller's own limits: the
    remaining-spend headers (``remaining_headers``), the IETF ``RateLimit-Policy`` and
    ``RateLimit`` fields (``ratelimit_headers``), both, or nothing (None)."""
    if remaining and fields:
        return lambda decision: remaining_headers(decision) + ratelimit_fields(decision)
    if remaining:
        return remaining_headers
    if fields:
        return ratelimit_fields
    return None


_PREFIX: Final = "x-spendguard-"


def remaining_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    """The remaining-spend headers of ``decision``'s identity's own key limits."""
    headers: list[tuple[bytes, bytes]] = []
    for state, target in own_key_limits(decision):
        names = _NAMES.get(target.window)
        if names is None:
            w = target.window.value
            names = _NAMES[target.window] = (
                f"{_PREFIX}limit-usd-{w}".encode(),
                f"{_PREFIX}remaining-usd-{w}".encode(),
                f"{_PREFIX}reset-{w}".encode(),
            )
        remaining = max(0, state.limit - state.used)
        headers += [
            (names[0], _usd(state.limit)),
            (names[1], _usd(remaining)),
            (names[2], _reset(target, decision)),
        ]
    return headers


_NAMES: dict[object, tuple[bytes, bytes, bytes]] = {}
_RESETS: dict[tuple[object, int, int, int], bytes] = {}


def _reset(target: Limit, decision: Decision) -> bytes:
    """When the window of ``decision``'s start resets, as an ISO time (one per period)."""
    window, t0 = target.window, decision.t0
    key = (window, t0.year, t0.month, t0.day)  # t0 is UTC: its day decides either period
    found = _RESETS.get(key)
    if found is None:
        if len(_RESETS) >= 64:
            _RESETS.clear()
        found = _RESETS[key] = window.end(decision.t0).strftime("%Y-%m-%dT%H:%M:%SZ").encode()
    return found


def _usd(micros: int) -> bytes:
    # Always six decimals (whole micro-USD), so a client can parse every value the same way.
    # Integer arithmetic: exact, and no Decimal per header.
    sign = "-" if micros < 0 else ""
    whole, part = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{part:06d}".encode()
