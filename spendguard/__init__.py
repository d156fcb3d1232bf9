"""spendguard: spend limits for LLM gateways.

from spendguard import SpendGuardMiddleware
app.add_middleware(SpendGuardMiddleware)   # reads SPENDGUARD_* settings

The public names are imported on first access, so importing one part of the package (say
``spendguard.ledger`` from a CLI or a test) does not load the middleware and everything it
pulls in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Public name -> the submodule defining it.
_HOMES = {
    "ConfigurationError": "errors",
    "LedgerUnavailable": "errors",
    "SpendGuardError": "errors",
    "StoreFull": "errors",
    "StoreUnavailable": "errors",
    "Decision": "guard",
    "SpendGuard": "guard",
    "Verdict": "guard",
    "Identity": "identity",
    "SpendGuardMiddleware": "middleware",
    "Settings": "settings",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
