"""Filling the cache after a miss (design.md, "Cache misses").

A preflight that misses (the team's policy hash or a usage key is absent: first request, a
restart, expiry, eviction) reads what is missing from the ledger and writes only keys that are
still absent, so nothing postflight added meanwhile is overwritten. Identical concurrent reads
are coalesced: 100 misses for one team make one ledger read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

import anyio

from ..ledger import Account, Ledger
from ..limits import Balance, Check, KeyCodec, KeyPlan, Limit, Policy
from ..store import Preflight, Store, UsageFill
from .singleflight import SingleFlight

T = TypeVar("T")


class CacheFiller:
    def __init__(
        self,
        ledger: Ledger,
        store: Store,
        codec: KeyCodec,
        *,
        policy_ttl: float,
        db_timeout: float,
        ensure_connected: Callable[[], Awaitable[None]],
        on_filled: Callable[[str], None] | None = None,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._codec = codec
        self._policy_ttl = policy_ttl
        self._db_timeout = db_timeout
        self._ensure_connected = ensure_connected
        # Told the team after each fill: the fill's ledger read may predate a settlement whose
        # cache refresh ran before the fill's write, so the worker refreshes the team once more.
        self._on_filled = on_filled
        self._limits: SingleFlight[tuple[list[Policy], Account | None]] = SingleFlight()
        self._balances: SingleFlight[Account | None] = SingleFlight()
        self._aggregates: SingleFlight[dict[tuple[Limit, str], int]] = SingleFlight()

    async def fill(self, plan: KeyPlan, miss: Preflight) -> None:
        """Read what ``miss`` lacks from the ledger and fill the absent keys."""
        await self._ensure_connected()
        fields: dict[str, int] | None = None
        if miss.missing_policy:
            policies, account = await self._load(
                self._limits, ("limits", plan.team), self._ledger.load_limits, plan.team
            )
            fields = self._codec.policy_fields(policies, balance=account is not None)
            wanted = [c for c in plan.checks if c.field in fields]
        else:
            wanted = list(miss.missing_usage)
        fills = await self._balance_fills(plan.team, wanted)
        fills += await self._limit_fills(plan.team, wanted)
        await self._store.fill(plan, fields, fills, policy_ttl=self._policy_ttl)
        if fills and self._on_filled is not None:
            self._on_filled(plan.team)

    async def _balance_fills(self, team: str, wanted: list[Check]) -> list[UsageFill]:
        check = next((c for c in wanted if isinstance(c.target, Balance)), None)
        if check is None:
            return []
        account = await self._load(
            self._balances, ("balance", team), self._ledger.load_balance, team
        )
        if account is None:  # closed between the policy read and now: nothing to fill
            return []
        return [UsageFill(check.usage_key, account.charged, check.expires_at, account.topped_up)]

    async def _limit_fills(self, team: str, wanted: list[Check]) -> list[UsageFill]:
        checks = [(c, c.target) for c in wanted if isinstance(c.target, Limit)]
        if not checks:
            return []
        keys = [(limit, c.bucket) for c, limit in checks]
        loaded = await self._load(
            self._aggregates, ("agg", team, tuple(keys)), self._ledger.load_aggregates, team, keys
        )
        return [
            UsageFill(c.usage_key, int(loaded[(limit, c.bucket)]), c.expires_at)
            for c, limit in checks
        ]

    async def _load(
        self,
        flights: SingleFlight[T],
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        *args: object,
    ) -> T:
        async def call() -> T:
            with anyio.fail_after(self._db_timeout):
                return await fn(*args)

        return await flights.do(key, call)
