"""spendguard: spend limits for LLM gateways.

from spendguard import SpendGuardMiddleware
app.add_middleware(SpendGuardMiddleware)   # reads SPENDGUARD_* settings
"""

from __future__ import annotations

from .asgi.middleware import SpendGuardMiddleware
from .engine.admin import Admin, BalanceReport, LimitUsage, UsageReport
from .engine.decision import Admission, Decision, InferenceRequest, Verdict
from .engine.guard import SpendGuard
from .errors import (
    ConfigurationError,
    LedgerUnavailable,
    SpendGuardError,
    StoreFull,
    StoreUnavailable,
)
from .identity import Identity
from .limits import Balance, Limit, Period, Policy, Subject
from .settings import Settings
from .usage import Dialect, Usage

__all__ = [
    "Admin",
    "Admission",
    "Balance",
    "BalanceReport",
    "ConfigurationError",
    "Decision",
    "Dialect",
    "Identity",
    "InferenceRequest",
    "LedgerUnavailable",
    "Limit",
    "LimitUsage",
    "Period",
    "Policy",
    "Settings",
    "SpendGuard",
    "SpendGuardError",
    "SpendGuardMiddleware",
    "StoreFull",
    "StoreUnavailable",
    "Subject",
    "Usage",
    "UsageReport",
    "Verdict",
]
__version__ = "0.1.0"
