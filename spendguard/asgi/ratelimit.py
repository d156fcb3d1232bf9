"""OpenAI's rate-limit headers, for the caller's own API key (design.md, "Rates").

Every answer to a checked inference whose API key has an RPM or TPM rate carries, for each of
them (the provider's response and spendguard's own 429 alike)::

    x-ratelimit-limit-requests: 60
    x-ratelimit-remaining-requests: 59
    x-ratelimit-reset-requests: 1m0.5s

(and the same with ``-tokens``), as OpenAI sends them, so clients that read them work
unchanged. The values are the preflight's, after counting this request: nothing extra is asked
of the store. A team's rates are not shown (a key's holder is told about its own only), nor is
a max-parallel cap (OpenAI has no header for one).
"""

from __future__ import annotations

from typing import Final

from ..engine.decision import Decision
from ..limits.model import SubjectKind
from ..limits.rates import RateKind

__all__ = ["rate_limit_headers", "reset_duration"]

# Per rate: its header names (limit, remaining, reset), encoded once.
_NAMES: Final = {
    kind: tuple(f"x-ratelimit-{part}-{name}".encode() for part in ("limit", "remaining", "reset"))
    for kind, name in ((RateKind.RPM, "requests"), (RateKind.TPM, "tokens"))
}


def rate_limit_headers(decision: Decision | None) -> list[tuple[bytes, bytes]]:
    """The ``x-ratelimit-*`` headers of the key's own RPM and TPM rates (none without)."""
    if decision is None or not decision.rates:
        return []
    state = decision.rates[0]
    if state.scope is not SubjectKind.API_KEY:
        return []
    headers: list[tuple[bytes, bytes]] = []
    for kind, limit in ((RateKind.RPM, state.rates.rpm), (RateKind.TPM, state.rates.tpm)):
        if limit is None:
            continue
        limit_name, remaining_name, reset_name = _NAMES[kind]
        headers += [
            (limit_name, str(limit).encode()),
            (remaining_name, str(state.remaining(kind)).encode()),
            (reset_name, reset_duration(state.reset_ms(kind)).encode()),
        ]
    return headers


def reset_duration(ms: int) -> str:
    """A duration as OpenAI writes it: ``0s``, ``20ms``, ``1.5s``, ``6m0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"
