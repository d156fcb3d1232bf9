"""Filling the cache after a miss (design.md, "Cache misses").

A preflight that misses (the team's policy hash or a usage key is absent: first request, a
restart, expiry, eviction) reads what is missing from the ledger and writes only keys that are
still absent, so nothing postflight added meanwhile is overwritten. Identical concurrent reads
are coalesced: 100 misses for one team make one ledger read.

Stale while revalidate: the last policies read for each team are kept in process. When the
ledger can't be read on a policy miss, a team seen before keeps being checked against them (a
WARNING and ``spendguard_stale_policy_fills_total``) for up to ``policy_stale_max`` seconds
since that read; only a team this process never read gets the 503. The trade-off: a change
made in the ledger that this process had not read yet waits for the ledger to come back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import NamedTuple, TypeVar

import anyio

from .. import metrics
from ..errors import LedgerUnavailable
from ..ledger import Account, Ledger
from ..limits import Balance, Check, KeyCodec, KeyPlan, Limit, Policy
from ..limits.rates import Rates
from ..store import Preflight, Store, UsageFill
from .singleflight import SingleFlight

T = TypeVar("T")
log = logging.getLogger("spendguard")

# Teams whose last read is kept; past it the memory starts over (a bound, not an LRU).
_MAX_KNOWN_TEAMS = 100_000


class _Known(NamedTuple):
    policies: list[Policy]
    account: Account | None
    models: dict[str | None, list[str]]  # allowed model patterns per API key (None: team)
    rates: dict[str | None, Rates]  # request rates per API key (None: team)
    read_at: float  # time.monotonic() of the ledger read


class _Limits(NamedTuple):
    policies: list[Policy]
    account: Account | None
    models: dict[str | None, list[str]]
    rates: dict[str | None, Rates]


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
        policy_stale_max: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
        on_filled: Callable[[str], None] | None = None,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._codec = codec
        self._policy_ttl = policy_ttl
        self._db_timeout = db_timeout
        self._ensure_connected = ensure_connected
        self._stale_max = policy_stale_max
        self._monotonic = monotonic
        self._known: dict[str, _Known] = {}
        # Told the team after each fill: the fill's ledger read may predate a settlement whose
        # cache refresh ran before the fill's write, so the worker refreshes the team once more.
        self._on_filled = on_filled
        self._limits: SingleFlight[_Limits] = SingleFlight()
        self._balances: SingleFlight[Account | None] = SingleFlight()
        self._aggregates: SingleFlight[dict[tuple[Limit, str], int]] = SingleFlight()

    async def fill(self, plan: KeyPlan, miss: Preflight) -> None:
        """Read what ``miss`` lacks from the ledger and fill the absent keys."""
        fields: dict[str, int | str] | None = None
        if miss.missing_policy:
            limits, fresh = await self._policies(plan.team)
            account = limits.account
            fields = self._codec.policy_fields(
                limits.policies,
                balance=account is not None,
                balance_hard=account is not None and account.hard,
                models=limits.models,
                rates=limits.rates,
            )
            if not fresh:
                # The ledger is down: only the policy hash. Usage keys normally outlive it; the
                # next preflight names any that are missing, and only those need the ledger.
                await self._store.fill(plan, fields, [], policy_ttl=self._policy_ttl)
                return
            wanted = [c for c in plan.checks if c.field in fields]
        else:
            await self._ensure_connected()
            wanted = list(miss.missing_usage)
        fills = await self._balance_fills(plan.team, wanted)
        fills += await self._limit_fills(plan.team, wanted)
        await self._store.fill(plan, fields, fills, policy_ttl=self._policy_ttl)
        if fills and self._on_filled is not None:
            self._on_filled(plan.team)

    async def _load_limits(self, team: str) -> _Limits:
        policies, account = await self._ledger.load_limits(team)
        models = await self._ledger.load_models(team)
        return _Limits(policies, account, models, await self._ledger.load_rates(team))

    async def _policies(self, team: str) -> tuple[_Limits, bool]:
        """The team's policies and account from the ledger (fresh); the last ones read (not
        fresh) when the ledger can't be read and they are recent enough (module docstring)."""
        try:
            await self._ensure_connected()
            limits = await self._load(self._limits, ("limits", team), self._load_limits, team)
        except (LedgerUnavailable, TimeoutError) as exc:
            known = self._known.get(team)
            if known is None or self._monotonic() - known.read_at > self._stale_max:
                raise
            metrics.STALE_POLICY_FILLS.inc()
            log.warning(
                "spendguard ledger unreadable (%r): team %s keeps the policies read %.0f s ago",
                exc,
                team,
                self._monotonic() - known.read_at,
            )
            return _Limits(known.policies, known.account, known.models, known.rates), False
        if len(self._known) >= _MAX_KNOWN_TEAMS and team not in self._known:
            self._known.clear()
        self._known[team] = _Known(*limits, self._monotonic())
        return limits, True

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
