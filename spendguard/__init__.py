"""spendguard: spend limits for LLM gateways.

from spendguard import SpendGuardMiddleware
app.add_middleware(SpendGuardMiddleware)   # reads SPENDGUARD_* settings
"""

from __future__ import annotations

from .errors import (
    ConfigurationError,
    LedgerUnavailable,
    SpendGuardError,
    StoreFull,
    StoreUnavailable,
)
from .guard import Decision, SpendGuard, Verdict
from .identity import Identity
from .middleware import SpendGuardMiddleware
from .settings import Settings

__all__ = [
    "ConfigurationError",
    "Decision",
    "Identity",
    "LedgerUnavailable",
    "Settings",
    "SpendGuard",
    "SpendGuardError",
    "SpendGuardMiddleware",
    "StoreFull",
    "StoreUnavailable",
    "Verdict",
]
__version__ = "0.1.0"
