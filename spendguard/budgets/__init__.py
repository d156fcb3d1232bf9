"""Budgets: token and USD quotas over rolling windows for API keys, models and the fleet.

A request must pass both its budgets and its spend limits. See docs/rolling-budgets.md and
design.md "Budgets". This package reads the section (``config``, ``source``) and administers
it (``admin``, ``cli``); the round's budget part, which plans and decides, is
:mod:`spendguard.engine.budgets`.
"""

from __future__ import annotations

from typing import Any

from ..limits.model import BudgetLimit, Unit
from ..limits.windows import Rolling
from .config import (
    BudgetConfigError,
    BudgetsConfig,
    Scope,
    Storage,
    parse_budgets,
    parse_period,
    read_budgets,
)
from .source import BudgetsSource

__all__ = [
    "BudgetConfigError",
    "BudgetLimit",
    "BudgetsConfig",
    "BudgetsSource",
    "Rolling",
    "Scope",
    "Storage",
    "Unit",
    "parse_budgets",
    "parse_period",
    "read_budgets",
]

# The round's budget part lives in the engine (engine/budgets.py); these names stay importable
# from here, where the manual has always shown them. Resolved on first use: the engine's module
# imports this package's config, so importing it here at once would be circular.
_GATE_NAMES = frozenset(
    {
        "BudgetAdmission",
        "BudgetGate",
        "BudgetVerdict",
        "Denial",
        "gate_for",
        "make_gate",
        "recovery_gate",
        "source_of",
    }
)


def __getattr__(name: str) -> Any:
    if name in _GATE_NAMES:
        from ..engine import budgets as engine_budgets

        return getattr(engine_budgets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
