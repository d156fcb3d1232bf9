"""The fail-open tracker: what a process allowed while the store was unavailable.

Bounded: once it holds ``max_keys`` identities, requests from new identities are refused
(never allowed untracked). It is cleared when the store answers again: the allowed requests
were recorded in the ledger as usual, and settlement brings the store's cache up to date.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .. import metrics
from ..identity import Identity

log = logging.getLogger("spendguard")


@dataclass(slots=True)
class _Spend:
    requests: int = 0
    micros: int = 0


class OutageTracker:
    def __init__(self, max_keys: int) -> None:
        self._max = max_keys
        self._spend: dict[tuple[str, str | None], _Spend] = {}

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

    def charge(self, identity: Identity, micros: int) -> None:
        entry = self._spend.get((identity.team, identity.api_key))
        if entry is not None:
            entry.micros += micros

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
            metrics.FAIL_OPEN_TRACKED.set(0)

    def __len__(self) -> int:
        return len(self._spend)
