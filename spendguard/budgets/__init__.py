"""Budgets: token and USD quotas over rolling windows for API keys, models and the fleet.

Independent of spend limits and balances: a request must pass both. See docs/rolling-budgets.md
and design.md "Budgets"; :func:`gate_for` builds the gate the middleware uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..limits.model import BudgetLimit, Unit
from ..limits.windows import Rolling
from ..store import make_store
from .config import (
    BudgetConfigError,
    BudgetsConfig,
    Scope,
    Storage,
    parse_budgets,
    parse_period,
    read_budgets,
)
from .gate import BudgetAdmission, BudgetGate, BudgetVerdict, Denial, make_gate
from .source import BudgetsSource

if TYPE_CHECKING:
    from ..engine.guard import SpendGuard
    from ..engine.pricing import PriceTable
    from ..ledger import Ledger
    from ..settings import Settings
    from ..store import Store


def gate_for(guard: SpendGuard) -> BudgetGate | None:
    """The budgets of the guard's settings; None when no budgets section is configured at
    all (then not even a file is watched). A section with ``enabled: false`` still gets a
    gate: enabling it in the file applies without a restart."""
    settings = guard.settings
    source = source_of(settings)
    if source is None:
        return None
    store, owned = guard.store, False
    if not store.shared and settings.redis_url is not None:
        # A guard given a store of its own in this process: budgets still count where the
        # settings say (storage: redis), on a store the gate owns.
        store, owned = make_store(settings, guard.clock), True
    return make_gate(
        source,
        guard.prices,
        ledger=guard.ledger,
        override_ttl=settings.policy_ttl,
        fallback_max_buckets=settings.fail_open_max_keys,
        memory_max_buckets=settings.memory_max_keys,
        # The guard connects its ledger at start; without a lifespan, on first use.
        ensure_connected=guard._ensure_connected,
        clock=guard.clock,
        output=guard.output,  # the spend limits' reservation rule: the two engines agree
        store=store,
        owned=owned,
        override_timeout=settings.db_timeout,
        fit_min=settings.fit_min_output_tokens,
        ratelimit_fields=settings.ratelimit_headers,
        fit_by_default=settings.fit_by_default,
        unknown_model=settings.unknown_model,
    )


def source_of(settings: Settings) -> BudgetsSource | None:
    """The settings' budgets section (its file, watched, or the section itself); None when
    there is none."""
    if settings.budgets_file is not None:
        return BudgetsSource.from_file(settings.budgets_file)
    if settings.budgets is not None:
        return BudgetsSource(parse_budgets(settings.budgets))
    return None


def recovery_gate(
    settings: Settings, prices: PriceTable, ledger: Ledger, store: Store
) -> BudgetGate | None:
    """The budgets a standalone worker closes recovered holds with (``spendguard settle``):
    the gateways' section, on their shared store; None without budgets."""
    source = source_of(settings)
    if source is None:
        return None
    return make_gate(
        source,
        prices,
        ledger=ledger,
        override_ttl=settings.policy_ttl,
        fallback_max_buckets=settings.fail_open_max_keys,
        memory_max_buckets=settings.memory_max_keys,
        store=store,
        override_timeout=settings.db_timeout,
        unknown_model=settings.unknown_model,
    )


__all__ = [
    "BudgetAdmission",
    "BudgetConfigError",
    "BudgetGate",
    "BudgetLimit",
    "BudgetVerdict",
    "BudgetsConfig",
    "BudgetsSource",
    "Denial",
    "Rolling",
    "Scope",
    "Storage",
    "Unit",
    "gate_for",
    "make_gate",
    "parse_budgets",
    "parse_period",
    "read_budgets",
    "recovery_gate",
    "source_of",
]
