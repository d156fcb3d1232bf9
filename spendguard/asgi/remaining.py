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

from typing import Final

from ..engine.decision import Decision
from ..limits import Limit, SubjectKind
from ..money import micros_to_usd

__all__ = ["remaining_headers"]

_PREFIX: Final = "x-spendguard-"


def remaining_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    """The remaining-spend headers of ``decision``'s identity's own key limits."""
    headers: list[tuple[bytes, bytes]] = []
    api_key = decision.identity.api_key
    for state in decision.limits:
        target = state.check.target
        if (
            not isinstance(target, Limit)
            or target.subject.kind is not SubjectKind.API_KEY
            or target.subject.api_key != api_key
        ):
            continue
        window = target.window.value
        remaining = max(0, state.limit - state.used)
        reset = target.window.end(decision.t0).strftime("%Y-%m-%dT%H:%M:%SZ")
        headers += [
            (f"{_PREFIX}limit-usd-{window}".encode(), _usd(state.limit)),
            (f"{_PREFIX}remaining-usd-{window}".encode(), _usd(remaining)),
            (f"{_PREFIX}reset-{window}".encode(), reset.encode()),
        ]
    return headers


def _usd(micros: int) -> bytes:
    # Always six decimals (whole micro-USD), so a client can parse every value the same way.
    return f"{micros_to_usd(micros):.6f}".encode()
