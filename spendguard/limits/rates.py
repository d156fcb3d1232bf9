"""Request rates per key and per team: requests per minute (RPM), tokens per minute (TPM) and
requests in flight (design.md, "Rates").

A subject's rates live in the ledger and are cached in the team's policy hash next to its
limits, one field per subject (``rate:`` for the team, ``rate:<key>`` for a key) holding
``"<rpm> <tpm> <max_parallel>"`` (0: not limited). The preflight script checks them after the
spend limits, in the same call, and counts an admitted request in the subject's rate hash
(``{prefix}:{team}:spend:rate:<subject>``):

    m        the current minute (epoch ms // 60,000)
    r / t    requests / tokens counted in minute m
    pr / pt  the same for minute m - 1
    f:<id>   an admitted request in flight: "<deadline ms> <minute> <reserved tokens or ->"
    n        how many f: entries there are; e: a deadline no later than the earliest one

The window slides over the two fixed minutes, in steps of 100 ms: usage at tick ``k`` (of
600) into minute m is ``pr * (600 - k) / 600 + r`` (the previous minute weighted by how much of
it the last 60 s still cover). Every comparison is made on integers (both sides times 600; rates
are at most 10^12, so every product stays exact in the script's doubles), so the script and the
embedded store decide the same on the same numbers.

This module holds the rule (shared by the embedded store) and what a caller derives from a
scope's counters: what is left, when it resets, when a denied request would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from .model import SubjectKind

RATE_PREFIX: Final = "rate:"
WINDOW_MS: Final = 60_000
TICK_MS: Final = 100  # the previous minute's weight changes in steps of this
TICKS: Final = WINDOW_MS // TICK_MS
MAX_RATE: Final = 10**12  # bound on every rate, so counts times 600 stay exact in a double


class RateKind(StrEnum):
    RPM = "rpm"
    TPM = "tpm"
    PARALLEL = "par"


RATE_SUBJECTS: Final = {"key": SubjectKind.API_KEY, "team": SubjectKind.TEAM}
"""The subjects a rate has, by their names in the preflight script's reply (``key:rpm``)."""
RATE_WIRE: Final = {kind: name for name, kind in RATE_SUBJECTS.items()}


@dataclass(frozen=True, slots=True)
class Rates:
    """A subject's rates; None: not limited."""

    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_parallel"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_RATE
            ):
                raise ValueError(f"{name} must be a whole number from 1 to {MAX_RATE}")

    @property
    def empty(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_parallel is None

    def encode(self) -> str:
        """The policy-hash value: ``"<rpm> <tpm> <max_parallel>"``, 0 for none."""
        return f"{self.rpm or 0} {self.tpm or 0} {self.max_parallel or 0}"

    @classmethod
    def decode(cls, value: str) -> Rates:
        rpm, tpm, par = (int(v) for v in value.split(" "))
        return cls(rpm or None, tpm or None, par or None)


def rate_field(api_key: str | None) -> str:
    """The policy-hash field of a key's rates (``api_key`` encoded) or the team's (None)."""
    return RATE_PREFIX + (api_key or "")


def minute_of(now_ms: int) -> tuple[int, int]:
    """The minute containing ``now_ms`` and the weight of the previous one (the ticks of it the
    last 60 s still cover, 1 to 600)."""
    minute = now_ms // WINDOW_MS
    return minute, TICKS - (now_ms - minute * WINDOW_MS) // TICK_MS


def exceeds(prev: int, cur: int, cost: int, limit: int, weight: int) -> bool:
    """Whether ``cost`` more would pass ``limit`` in the sliding minute (integers only)."""
    return prev * weight + (cur + cost) * TICKS > limit * TICKS


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class RateState:
    """One scope's rates and counters as a preflight saw them (after counting the request
    when it was admitted); ``now_ms`` is the preflight's time."""

    scope: SubjectKind  # the key's or the team's
    rates: Rates
    prev_requests: int
    requests: int
    prev_tokens: int
    tokens: int
    in_flight: int
    now_ms: int

    @property
    def tracked(self) -> bool:
        """Whether admitted requests leave an in-flight entry postflight must close."""
        return self.rates.tpm is not None or self.rates.max_parallel is not None

    def remaining(self, kind: RateKind) -> int:
        """What is left of an RPM or TPM rate now (0 when over it)."""
        limit, prev, cur = self._parts(kind)
        left = limit * TICKS - prev * minute_of(self.now_ms)[1] - cur * TICKS
        return max(0, left // TICKS)

    def reset_ms(self, kind: RateKind) -> int:
        """Milliseconds until nothing counts against the rate any more (its initial state)."""
        _, prev, cur = self._parts(kind)
        rest = WINDOW_MS - self.now_ms % WINDOW_MS  # of this minute
        if cur:
            return rest + WINDOW_MS  # minute m counts fully until it ends, then fades
        return rest if prev else 0

    def wait_ms(self, kind: RateKind, cost: int) -> int | None:
        """Milliseconds until ``cost`` more would fit (0: now; None: never, it is larger
        than the rate). A slot of the parallel cap frees when a request ends: unknown, None."""
        if kind is RateKind.PARALLEL:
            return None
        limit, prev, cur = self._parts(kind)
        if cost > limit:
            return None
        elapsed = self.now_ms % WINDOW_MS
        if cur + cost <= limit:
            # Within this minute, from the first tick k at which the previous one has faded
            # enough: prev * (600 - k) <= (limit - cur - cost) * 600.
            if prev == 0:
                return 0
            k = TICKS - (limit - cur - cost) * TICKS // prev
            return max(0, k * TICK_MS - elapsed)
        # Next minute: this one becomes the previous (cur), the new one starts empty.
        k = max(0, TICKS - (limit - cost) * TICKS // cur) if cur else 0
        return WINDOW_MS - elapsed + k * TICK_MS

    def _parts(self, kind: RateKind) -> tuple[int, int, int]:
        if kind is RateKind.RPM:
            return self.rates.rpm or 0, self.prev_requests, self.requests
        return self.rates.tpm or 0, self.prev_tokens, self.tokens

    def encode(self) -> str:
        """The script's reply for a scope (parsed back by :func:`parse_state`)."""
        r = self.rates
        return " ".join(
            str(v)
            for v in (
                r.rpm or 0,
                r.tpm or 0,
                r.max_parallel or 0,
                self.prev_requests,
                self.requests,
                self.prev_tokens,
                self.tokens,
                self.in_flight,
            )
        )


def parse_state(scope: SubjectKind, raw: str, now_ms: int) -> RateState:
    rpm, tpm, par, pr, r, pt, t, n = map(int, raw.split(" "))
    rates = _decoded.get((rpm, tpm, par))
    if rates is None:  # a subject's rates change rarely: validated once, then shared
        if len(_decoded) >= _MAX_DECODED:
            _decoded.clear()
        rates = _decoded[(rpm, tpm, par)] = Rates(rpm or None, tpm or None, par or None)
    return RateState(scope, rates, pr, r, pt, t, n, now_ms)


_decoded: dict[tuple[int, int, int], Rates] = {}
_MAX_DECODED: Final = 4096


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class RateDenial:
    """Which rate of which scope refused a request, and what it would have cost."""

    state: RateState
    kind: RateKind
    cost: int  # 1 request, the reserved tokens, or 1 slot

    @property
    def limit(self) -> int:
        r = self.state.rates
        value = {RateKind.RPM: r.rpm, RateKind.TPM: r.tpm, RateKind.PARALLEL: r.max_parallel}
        return value[self.kind] or 0

    def retry_after(self) -> int | None:
        """Whole seconds until the request would fit (None: never, it is too large)."""
        if self.kind is RateKind.PARALLEL:
            return 1  # a slot frees when a request ends
        wait = self.state.wait_ms(self.kind, self.cost)
        return None if wait is None else max(1, -(-wait // 1000))


# The IETF rate-limit fields (draft-ietf-httpapi-ratelimit-headers-11): their names, and the
# quota units spendguard gives them.
POLICY_FIELD: Final = b"ratelimit-policy"
STATE_FIELD: Final = b"ratelimit"
# The draft registers "requests" (the default unit), "content-bytes" and "concurrent-requests".
# Tokens and money have no registered unit: their names carry spendguard's prefix, as the draft
# asks of implementation-specific values, so no client mistakes them for requests.
TOKENS_UNIT: Final = "spendguard-tokens"
USD_UNIT: Final = "spendguard-usd-micros"
