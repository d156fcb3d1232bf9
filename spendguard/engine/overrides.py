"""Per-key token budgets (``max_tokens_budget`` over ``budget_window``), read through a cache.

The ledger is the truth; each process keeps what it read for ``ttl`` seconds (the spend-limit
``policy_ttl``), so a change through the admin API applies here at once and on other replicas
within ``ttl``. A ledger that can't be read leaves the last value read in force; a key never
read is then checked against the fleet default.

Like the spend limits' policies, a warm request reads no SQL: :meth:`OverrideCache.peek`
answers from memory. Only a key not read for ``ttl`` waits for a read, which concurrent
requests of that key share (one query) and which is bounded by ``timeout``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from ..errors import LedgerUnavailable
from ..identity import Identity
from ..ledger import BudgetOverride, Ledger
from .singleflight import SingleFlight

log = logging.getLogger("spendguard.budgets")


class OverrideCache:
    MAX_ENTRIES = 100_000

    def __init__(
        self,
        ledger: Ledger,
        *,
        ttl: float = 60.0,
        timeout: float = 5.0,
        ensure_connected: Callable[[], Awaitable[None]] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ledger = ledger
        self._ttl = ttl
        self._timeout = timeout
        self._reads: SingleFlight[BudgetOverride | None] = SingleFlight()
        self._ensure = ensure_connected
        self._monotonic = monotonic
        self._entries: dict[tuple[str, str], tuple[float, BudgetOverride | None]] = {}
        # Counts evictions: a read that began before one (it may hold the value the change
        # replaced) answers its caller but is not kept.
        self._changes = 0

    def peek(self, identity: Identity) -> tuple[bool, BudgetOverride | None]:
        """(True, the key's override or None) when read less than ``ttl`` ago; (False, None)
        when :meth:`get` must read it."""
        if identity.api_key is None:
            return True, None
        entry = self._entries.get((identity.team, identity.api_key))
        if entry is not None and entry[0] > self._monotonic():
            return True, entry[1]
        return False, None

    async def get(self, identity: Identity) -> BudgetOverride | None:
        known, found = self.peek(identity)
        if known or identity.api_key is None:
            return found
        key = (identity.team, identity.api_key)
        entry = self._entries.get(key)
        return await self._reads.do(key, lambda: self._read(key, entry))

    async def _read(
        self, key: tuple[str, str], entry: tuple[float, BudgetOverride | None] | None
    ) -> BudgetOverride | None:
        now, changes = self._monotonic(), self._changes
        try:
            with anyio.fail_after(self._timeout):
                if self._ensure is not None:
                    await self._ensure()
                found = await self._ledger.budget_override(*key)
        except (LedgerUnavailable, TimeoutError) as exc:
            log.warning("budget override of a key unreadable, last known kept: %r", exc)
            return entry[1] if entry is not None else None
        if changes != self._changes:
            return found
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = (now + self._ttl, found)
        return found

    def evict(self, team: str, api_key: str) -> None:
        self._changes += 1
        self._entries.pop((team, api_key), None)


class CustomerBalances:
    """What each customer's prepaid account was topped up with, read through a cache like
    :class:`OverrideCache` (``ttl``, one read per customer at a time, bounded by
    ``timeout``): a warm request reads no SQL. None: the customer has no account."""

    MAX_ENTRIES = 100_000

    def __init__(
        self,
        ledger: Ledger,
        *,
        ttl: float = 60.0,
        timeout: float = 5.0,
        ensure_connected: Callable[[], Awaitable[None]] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ledger = ledger
        self._ttl = ttl
        self._timeout = timeout
        self._reads: SingleFlight[int | None] = SingleFlight()
        self._ensure = ensure_connected
        self._monotonic = monotonic
        self._entries: dict[str, tuple[float, int | None]] = {}
        self._changes = 0  # top-ups written here (see OverrideCache._changes)

    def peek(self, customer: str) -> tuple[bool, int | None]:
        """(True, topped up or None) when read less than ``ttl`` ago; (False, None) when
        :meth:`get` must read it (``customer`` encoded)."""
        entry = self._entries.get(customer)
        if entry is not None and entry[0] > self._monotonic():
            return True, entry[1]
        return False, None

    async def get(self, customer: str) -> int | None:
        known, found = self.peek(customer)
        if known:
            return found
        return await self._reads.do(customer, lambda: self._read(customer))

    async def _read(self, customer: str) -> int | None:
        now, changes = self._monotonic(), self._changes
        entry = self._entries.get(customer)
        try:
            with anyio.fail_after(self._timeout):
                if self._ensure is not None:
                    await self._ensure()
                found = await self._ledger.customer_topped_up(customer)
        except (LedgerUnavailable, TimeoutError) as exc:
            log.warning("a customer's balance is unreadable, last known kept: %r", exc)
            return entry[1] if entry is not None else None
        if changes != self._changes:
            return found
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[customer] = (now + self._ttl, found)
        return found

    def set(self, customer: str, topped_up: int) -> None:
        """What this process just wrote (a top-up): in force here at once."""
        self._changes += 1
        self._entries[customer] = (self._monotonic() + self._ttl, topped_up)
