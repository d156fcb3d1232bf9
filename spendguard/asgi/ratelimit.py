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

from collections.abc import Iterator
from typing import Final

from ..clock import to_millis
from ..engine.decision import Decision
from ..limits.model import Limit, SubjectKind
from ..limits.rates import POLICY_FIELD, STATE_FIELD, TOKENS_UNIT, USD_UNIT, RateKind
from ..store import LimitState

__all__ = ["rate_limit_headers", "ratelimit_fields", "reset_duration"]

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
    whole, milli = divmod(rest, 1000)
    seconds = f"{whole}.{milli:03d}".rstrip("0") if milli else str(whole)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


# -- the IETF fields ----------------------------------------------------------------------------
# RateLimit-Policy and RateLimit as draft-ietf-httpapi-ratelimit-headers-11 (May 2026) defines
# them: Structured Field lists of String items, the policy's name, with parameters (q: quota,
# qu: quota unit, w: window in seconds; r: what is left, t: seconds in which it is).
_SF_INTEGER_MAX: Final = 999_999_999_999_999  # a Structured Field Integer has 15 digits


def _int(value: int) -> int:
    return min(max(0, value), _SF_INTEGER_MAX)


def _seconds(ms: int) -> int:
    return -(-max(0, ms) // 1000)


def own_key_limits(decision: Decision) -> Iterator[tuple[LimitState, Limit]]:
    """The spend limits of ``decision``'s own API key, with their states: what a key's holder
    is told about (never its team's, a balance or another key's)."""
    api_key = decision.identity.api_key
    for state in decision.limits:
        target = state.check.target
        if (
            isinstance(target, Limit)
            and target.subject.kind is SubjectKind.API_KEY
            and target.subject.api_key == api_key
        ):
            yield state, target


def ratelimit_fields(decision: Decision | None) -> list[tuple[bytes, bytes]]:
    """``RateLimit-Policy`` and ``RateLimit`` for the caller's own API key: its spend limits
    (``key-usd-day``, ``key-usd-month``, in micro-USD), its RPM, TPM and parallel cap
    (``key-rpm``, ``key-tpm``, ``key-parallel``). Team limits, balances and budgets shared by
    others are never shown. None of them: no fields."""
    if decision is None:
        return []
    policies: list[str] = []
    states: list[str] = []
    now_ms = to_millis(decision.t0)
    for state, target in own_key_limits(decision):
        name = f'"key-usd-{target.window.value}"'
        start, end = target.window.start(decision.t0), target.window.end(decision.t0)
        length = int((end - start).total_seconds())
        policies.append(f'{name};q={_int(state.limit)};qu="{USD_UNIT}";w={length}')
        left = _seconds(to_millis(end) - now_ms)
        states.append(f"{name};r={_int(state.limit - state.used)};t={left}")
    rated = decision.rates[0] if decision.rates else None
    if rated is not None and rated.scope is SubjectKind.API_KEY:
        rates = rated.rates
        for kind, limit, unit in (
            (RateKind.RPM, rates.rpm, ""),
            (RateKind.TPM, rates.tpm, f';qu="{TOKENS_UNIT}"'),
        ):
            if limit is None:
                continue
            name = f'"key-{kind.value}"'
            policies.append(f"{name};q={_int(limit)}{unit};w=60")
            reset = _seconds(rated.reset_ms(kind))
            states.append(f"{name};r={_int(rated.remaining(kind))};t={reset}")
        if rates.max_parallel is not None:
            cap = rates.max_parallel
            policies.append(f'"key-parallel";q={_int(cap)};qu="concurrent-requests"')
            states.append(f'"key-parallel";r={_int(cap - rated.in_flight)}')
    if not policies:
        return []
    return [(POLICY_FIELD, ", ".join(policies).encode()), (STATE_FIELD, ", ".join(states).encode())]
