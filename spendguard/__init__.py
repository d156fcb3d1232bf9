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
from .providers import (
    STATE_PROVIDER_KEY,
    KeyState,
    Lease,
    NoCapacity,
    ProviderKey,
    ProviderPool,
    Refusal,
    retry_after_seconds,
)
from .settings import Settings
from .usage import Dialect, Usage

__all__ = [
    "STATE_PROVIDER_KEY",
    "Admin",
    "Admission",
    "Balance",
    "BalanceReport",
    "ConfigurationError",
    "Decision",
    "Dialect",
    "Identity",
    "InferenceRequest",
    "KeyState",
    "Lease",
    "LedgerUnavailable",
    "Limit",
    "LimitUsage",
    "NoCapacity",
    "Period",
    "Policy",
    "ProviderKey",
    "ProviderPool",
    "Refusal",
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
    "retry_after_seconds",
]
__version__ = "0.1.0"
