"""Budgets: token and USD quotas over rolling windows for API keys, models and the fleet.

Independent of spend limits and balances: a request must pass both. See the README section
"Budgets" and design.md "Budgets"; :func:`gate_for` builds the gate the middleware uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..limits.model import Unit
from ..limits.windows import Rolling
from .config import (
    BudgetConfigError,
    BudgetLimit,
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


def gate_for(guard: SpendGuard) -> BudgetGate | None:
    """The budgets of the guard's settings; None when no budgets section is configured at
    all (then not even a file is watched). A section with ``enabled: false`` still gets a
    gate: enabling it in the file applies without a restart."""
    settings = guard.settings
    if settings.budgets_file is not None:
        source = BudgetsSource.from_file(settings.budgets_file)
    elif settings.budgets is not None:
        source = BudgetsSource(parse_budgets(settings.budgets))
    else:
        return None
    url = None if settings.redis_url is None else settings.redis_url.get_secret_value()
    from ..store.redis import redis_parts

    spend_store = redis_parts(guard.store)
    return make_gate(
        source,
        guard.prices,
        redis_url=url,
        key_prefix=settings.key_prefix,
        redis_timeout=settings.redis_timeout,
        ledger=guard.ledger,
        override_ttl=settings.policy_ttl,
        fallback_max_buckets=settings.fail_open_max_keys,
        memory_max_buckets=settings.memory_max_keys,
        # The guard connects its ledger at start; without a lifespan, on first use.
        ensure_connected=guard._ensure_connected,
        clock=guard.clock,
        output=guard.output,  # the spend limits' reservation rule: the two engines agree
        spend_store=spend_store,
        override_timeout=settings.db_timeout,
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
]
