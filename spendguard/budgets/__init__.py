"""Budgets: token and USD quotas over rolling windows for API keys, models and the fleet.

A request must pass both its budgets and its spend limits. See docs/rolling-budgets.md and
design.md "Budgets". This package reads the section (``config``, ``source``) and administers
it (``admin``, ``cli``); the round's budget part, which plans and decides, is
:mod:`spendguard.engine.budgets`.
"""

from __future__ import annotations

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
