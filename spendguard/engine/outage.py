"""The fail-open tracker: what a process allowed while the store was unavailable.

Bounded: once it holds ``max_keys`` identities, requests from new identities are refused
(never allowed untracked). It is cleared when the store answers again: the allowed requests
were recorded in the ledger as usual, and settlement brings the store's cache up to date.

It also enforces what it knows. Every preflight the store answered leaves the usage and limit
of each checked key here (the last ones seen), and every charge the store applied after it is
added; during an outage a request is refused with the limit's 429 once that usage plus what
the outage let through on the same key reaches the limit. A key this process never saw
checked can't be enforced, only counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import metrics
from ..identity import Identity
from ..limits import KeyPlan
from ..store import LimitState

log = logging.getLogger("spendguard")


@dataclass(slots=True)
class _Spend:
    requests: int = 0
    micros: int = 0


class OutageTracker:
    # Usage keys whose last checked state is kept; past it the memory starts over.
    MAX_KNOWN_KEYS = 100_000

    def __init__(self, max_keys: int) -> None:
        self._max = max_keys
        self._spend: dict[tuple[str, str | None], _Spend] = {}
        self._known: dict[str, LimitState] = {}  # usage key -> last state a preflight saw
        self._counted: dict[str, int] = {}  # usage key -> estimates allowed in this outage

    def remember(self, limits: Sequence[LimitState]) -> None:
        """What the store just answered for these keys (called on every allowed preflight)."""
        known = self._known
        if len(known) >= self.MAX_KNOWN_KEYS:
            known.clear()
        for state in limits:
            known[state.check.usage_key] = state

    def add(self, usage_keys: Iterable[str], micros: int) -> None:
        """A charge the store applied after its last answer for these keys."""
        known = self._known
        for key in usage_keys:
            state = known.get(key)
            if state is not None:
                known[key] = LimitState(state.check, state.limit, state.used + micros)

    def exhausted(self, plan: KeyPlan) -> LimitState | None:
        """The first limit of ``plan`` known to be used up, counting what this outage let
        through on its key; None when none is (or none is known)."""
        for check in plan.checks:
            state = self._known.get(check.usage_key)
            if state is None:
                continue
            used = state.used + self._counted.get(check.usage_key, 0)
            if used >= state.limit:
                return LimitState(check, state.limit, used)
        return None

    def admit(self, identity: Identity) -> bool:
        key = (identity.team, identity.api_key)
        entry = self._spend.get(key)
        if entry is None:
            if len(self._spend) >= self._max:
                return False
            entry = self._spend[key] = _Spend()
            metrics.FAIL_OPEN_TRACKED.set(len(self._spend))
        entry.requests += 1
        return True

    def charge(self, identity: Identity, micros: int, usage_keys: Iterable[str] = ()) -> None:
        entry = self._spend.get((identity.team, identity.api_key))
        if entry is not None:
            entry.micros += micros
            counted = self._counted
            for key in usage_keys:
                counted[key] = counted.get(key, 0) + micros

    def spent(self, identity: Identity) -> tuple[int, int]:
        """(requests, micro-USD) allowed for ``identity`` during the current outage."""
        entry = self._spend.get((identity.team, identity.api_key))
        return (0, 0) if entry is None else (entry.requests, entry.micros)

    def clear(self) -> None:
        """The store answers again: say what the outage let through, then forget it."""
        if self._spend:
            requests = sum(e.requests for e in self._spend.values())
            micros = sum(e.micros for e in self._spend.values())
            log.warning(
                "spendguard store is back: %d requests of %d identities were allowed while it "
                "was unavailable, estimated %d micro-USD; settlement brings the cache up to date",
                requests,
                len(self._spend),
                micros,
            )
            self._spend.clear()
            self._counted.clear()
            metrics.FAIL_OPEN_TRACKED.set(0)

    def __len__(self) -> int:
        return len(self._spend)
