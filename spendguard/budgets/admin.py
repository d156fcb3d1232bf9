"""Budget administration: inspect, reset, per-key budgets. The CLI and a gateway's own admin
endpoints sit on :class:`BudgetAdmin`::

    admin = BudgetAdmin.of(gate)            # in the gateway: its stores, its config
    report = await admin.inspect()          # effective config + each scope x window's counters
    await admin.reset("per_api_key", window="daily", team_id="acme", api_key_id="alpha")
    await admin.set_key_budget("acme", "alpha", max_tokens=100_000, budget_window="24h")

A reset deletes the committed usage of the chosen windows; on Redis every replica sees it at
once. Holds of requests in flight stay (they end, or expire, by themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ..clock import to_micros, utcnow
from ..engine.budgets import BudgetGate, override_window, scope_of
from ..identity import Identity, encode_id
from ..ledger import BudgetOverride, Ledger
from ..limits.model import BudgetLimit, SubjectKind
from ..limits.windows import PREPAID, Rolling
from ..money import MAX_TOTAL_MICROS, checked_amount, usd_text, usd_to_micros
from ..store import Store
from ..store.rolling import Bucket, BucketCheck, WindowCheck
from .config import BudgetsConfig, Scope, parse_period


@dataclass(frozen=True, slots=True)
class Counter:
    scope: Scope
    subject: str  # encoded: "team:key", "team:end user", a tag, a model, or "" for the fleet
    window: str
    tokens: int  # committed in the window, plus live holds
    cost_micros: int
    limit: BudgetLimit  # the amounts of this window
    requests: int = 0  # admitted in the window, plus live holds

    def as_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope.value,
            "subject": self.subject,
            "window": self.window,
            "tokens": self.tokens,
            "cost_micro_usd": self.cost_micros,
            "requests": self.requests,
            "limit": self.limit.as_json(),
        }


@dataclass(frozen=True, slots=True)
class BudgetReport:
    config: BudgetsConfig
    storage: str  # the store actually used: memory or redis
    counters: tuple[Counter, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config.as_json(),
            "storage": self.storage,
            "counters": [c.as_json() for c in self.counters],
        }


@dataclass(frozen=True, slots=True)
class CustomerBalance:
    """A customer's prepaid account: what was topped up and what its teams used (counted at
    admission like every budget, live holds included), in micro-USD."""

    customer: str  # as the app named it
    topped_up: int
    used: int

    @property
    def left(self) -> int:
        return self.topped_up - self.used

    def as_json(self) -> dict[str, Any]:
        return {
            "customer": self.customer,
            "topped_up_micros": self.topped_up,
            "topped_up_usd": usd_text(self.topped_up),
            "used_micros": self.used,
            "balance_micros": self.left,
            "balance_usd": usd_text(self.left),
        }


class BudgetAdmin:
    def __init__(
        self,
        config: BudgetsConfig,
        store: Store,
        *,
        ledger: Ledger | None = None,
        gate: BudgetGate | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.ledger = ledger
        self.gate = gate

    @classmethod
    def of(cls, gate: BudgetGate, ledger: Ledger | None = None) -> BudgetAdmin:
        config = gate.config
        return cls(config, gate.store_for(config), ledger=ledger, gate=gate)

    def _now_ms(self) -> int:
        clock = self.gate.clock if self.gate is not None else utcnow
        return to_micros(clock()) // 1000

    async def _buckets(self) -> list[Bucket]:
        return await self.store.buckets()

    async def _checks(self, bucket: Bucket) -> tuple[WindowCheck, ...]:
        config = self.config
        limit: BudgetLimit | None
        if bucket.kind is Scope.PER_API_KEY.kind:
            override = await self._override_of(bucket)
            if override is not None:
                limit = BudgetLimit(tokens=override.max_tokens)
                return (WindowCheck(override_window(override), limit),)
            limit = config.per_api_key
        elif bucket.kind is Scope.PER_MODEL.kind:
            limit = next(
                (lim for m, lim in config.per_model.items() if encode_id(m) == bucket.subject),
                None,
            )
        elif bucket.kind is Scope.PER_END_USER.kind:
            limit = config.per_end_user
        elif bucket.kind is Scope.PER_TAG.kind:
            limit = next(
                (lim for t, lim in config.per_tag.items() if encode_id(t) == bucket.subject),
                config.per_tag.get("*"),
            )
        elif bucket.kind is Scope.PER_CUSTOMER.kind:
            limit = next(
                (lim for n, lim in config.per_customer.items() if encode_id(n) == bucket.subject),
                config.per_customer.get("*"),
            )
        else:
            limit = config.global_
        if limit is None:
            return ()
        return tuple(
            WindowCheck(w, own)
            for w in config.windows
            if (own := limit.in_window(w.id)) is not None
        )

    async def _override_of(self, bucket: Bucket) -> BudgetOverride | None:
        if self.ledger is None:
            return None
        team, _, key = bucket.subject.partition(":")
        return await self.ledger.budget_override(team, key)

    # -- inspect --------------------------------------------------------------------------
    async def inspect(self) -> BudgetReport:
        """The effective config and every bucket's counters, window by window. Shared
        buckets' usage is for operators only: it never reaches a client."""
        now_ms = self._now_ms()
        counters: list[Counter] = []
        buckets = set(await self._buckets())
        buckets.add(Bucket(Scope.GLOBAL.kind, ""))
        for model in self.config.per_model:
            buckets.add(Bucket(Scope.PER_MODEL.kind, encode_id(model)))
        for bucket in sorted(buckets, key=lambda b: (scope_of(b).value, b.subject)):
            checks = await self._checks(bucket)
            if not checks:
                continue
            usage = await self.store.inspect_bucket(BucketCheck(bucket, checks), now_ms)
            for check, row in zip(checks, usage.windows, strict=True):
                counters.append(
                    Counter(
                        scope_of(bucket),
                        bucket.subject,
                        check.window.id,
                        row.tokens + usage.held_tokens,
                        row.cost + usage.held_cost,
                        check.limit,
                        row.requests + usage.held_requests,
                    )
                )
        storage = "redis" if self.store.shared else "memory"
        return BudgetReport(self.config, storage, tuple(counters))

    # -- reset ----------------------------------------------------------------------------
    async def reset(
        self,
        scope: Scope | str,
        *,
        window: str | None = None,
        team_id: str | None = None,
        api_key_id: str | None = None,
        model: str | None = None,
        end_user: str | None = None,
        tag: str | None = None,
        customer: str | None = None,
    ) -> int:
        """Clear recorded usage of a scope (one key, end user of a team, tag, customer or
        model, or all of the scope's buckets), in one window or all. Returns how many buckets
        were reset."""
        scope = Scope(scope)
        for name, value, own in (
            ("api_key_id", api_key_id, Scope.PER_API_KEY),
            ("model", model, Scope.PER_MODEL),
            ("end_user", end_user, Scope.PER_END_USER),
            ("tag", tag, Scope.PER_TAG),
            ("customer", customer, Scope.PER_CUSTOMER),
        ):
            if value is not None and scope is not own:
                raise ValueError(f"{name} is only for scope {own.value}")
        if window is not None and self.config.window(window) is None:
            # A key's own window is named after its period (24h); anything else is a typo.
            try:
                parse_period(window)
            except ValueError:
                known = ", ".join(w.id for w in self.config.windows) or "none"
                raise ValueError(f"unknown window {window!r} (configured: {known})") from None
        if scope is Scope.PER_API_KEY and api_key_id is not None:
            if team_id is None:
                raise ValueError("a per_api_key reset of one key needs team_id and api_key_id")
            ident = Identity(team_id, api_key_id)
            buckets = [Bucket(scope.kind, f"{ident.team}:{ident.api_key}")]
        elif scope is Scope.PER_MODEL and model is not None:
            buckets = [Bucket(scope.kind, encode_id(model))]
        elif scope is Scope.PER_END_USER and end_user is not None:
            if team_id is None:
                raise ValueError("a per_end_user reset of one end user needs team_id too")
            buckets = [Bucket(scope.kind, f"{encode_id(team_id)}:{encode_id(end_user)}")]
        elif scope is Scope.PER_TAG and tag is not None:
            buckets = [Bucket(scope.kind, encode_id(tag))]
        elif scope is Scope.PER_CUSTOMER and customer is not None:
            buckets = [Bucket(scope.kind, encode_id(customer))]
        elif scope is Scope.GLOBAL:
            buckets = [Bucket(scope.kind, "")]
        else:
            buckets = [b for b in await self._buckets() if b.kind is scope.kind]
        for bucket in buckets:
            windows = await self._reset_windows(bucket, window)
            await self.store.reset_bucket(bucket, windows)
        return len(buckets)

    async def _reset_windows(self, bucket: Bucket, window: str | None) -> list[Rolling]:
        windows = list(self.config.windows)
        if bucket.kind is Scope.PER_API_KEY.kind:
            override = await self._override_of(bucket)
            if override is not None:
                windows.append(override_window(override))
        if window is not None:
            windows = [w for w in windows if w.id == window]
        return windows

    # -- per-key budgets ------------------------------------------------------------------
    def _ledger(self) -> Ledger:
        if self.ledger is None:
            raise ValueError("per-key budgets are kept in the ledger: none is configured")
        return self.ledger

    async def set_key_budget(
        self, team_id: str, api_key_id: str, *, max_tokens: int, budget_window: str
    ) -> BudgetOverride:
        """Give a key its own token budget: it is checked against this instead of the fleet's
        per_api_key default (per-model and global still apply)."""
        if type(max_tokens) is not int or max_tokens <= 0:
            raise ValueError(f"max_tokens_budget must be a positive whole number: {max_tokens!r}")
        parse_period(budget_window)  # ValueError naming the problem
        ident = Identity(team_id, api_key_id)
        assert ident.api_key is not None
        override = BudgetOverride(
            ident.team, ident.api_key, team_id, api_key_id, max_tokens, budget_window
        )
        await self._ledger().set_budget_override(override)
        self._evict(ident)
        return override

    async def remove_key_budget(self, team_id: str, api_key_id: str) -> bool:
        ident = Identity(team_id, api_key_id)
        assert ident.api_key is not None
        removed = await self._ledger().remove_budget_override(ident.team, ident.api_key)
        self._evict(ident)
        return removed

    async def key_budgets(self) -> Sequence[BudgetOverride]:
        return await self._ledger().budget_overrides()

    # -- customers' prepaid accounts ------------------------------------------------------
    async def topup_customer(self, customer_id: str, usd: Decimal | str | int) -> CustomerBalance:
        """Add prepaid credit to a customer (the first top-up opens its account): every team
        of the customer draws from it, and a request it can't pay for is refused."""
        customer = _customer(customer_id)
        micros = checked_amount(usd_to_micros(usd), "a top-up", allow_zero=False)
        ledger = self._ledger()
        current = await ledger.customer_topped_up(customer)
        if current is not None and current + micros > MAX_TOTAL_MICROS:
            raise ValueError(f"top-ups of customer {customer_id!r} would exceed the bound")
        total = await ledger.topup_customer(customer, customer_id, micros)
        if self.gate is not None and self.gate.balances is not None:
            self.gate.balances.set(customer, total)  # in force here at once
        return await self._customer_balance(customer_id, customer, total)

    async def customer_balance(self, customer_id: str) -> CustomerBalance | None:
        """A customer's prepaid account; None when it has none."""
        customer = _customer(customer_id)
        total = await self._ledger().customer_topped_up(customer)
        if total is None:
            return None
        return await self._customer_balance(customer_id, customer, total)

    async def _customer_balance(
        self, customer_id: str, customer: str, total: int
    ) -> CustomerBalance:
        check = WindowCheck(PREPAID, BudgetLimit(cost_micros=total))
        bucket = Bucket(SubjectKind.CUSTOMER, customer)
        usage = await self.store.inspect_bucket(BucketCheck(bucket, (check,)), self._now_ms())
        return CustomerBalance(customer_id, total, usage.windows[0].cost + usage.held_cost)

    def _evict(self, ident: Identity) -> None:
        if self.gate is not None and self.gate.overrides is not None and ident.api_key:
            self.gate.overrides.evict(ident.team, ident.api_key)


def _customer(customer_id: str) -> str:
    if not isinstance(customer_id, str) or not customer_id or len(customer_id) > 256:
        raise ValueError("a customer is 1 to 256 characters")
    return encode_id(customer_id)
