"""A gateway with budgets in a test: :class:`Gateway` (spend limits on the embedded store, a
SQLite ledger, the settable clock) plus a budgets section, from a dict or a file, counted in
memory or on the Redis at ``redis_url``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.types import ASGIApp

from spendguard import SpendGuardMiddleware
from spendguard.budgets.admin import BudgetAdmin
from spendguard.engine.budgets import BudgetGate, gate_for

from .asgi import StateAuth
from .gateway import Gateway


def section(**overrides: Any) -> dict[str, Any]:
    """An enabled section: one hourly and one daily window, the given scopes."""
    out: dict[str, Any] = {
        "enabled": True,
        "windows": [{"id": "hourly", "period": "1h"}, {"id": "daily", "period": "24h"}],
        "scopes": {},
    }
    out.update(overrides)
    return out


class BudgetGateway(Gateway):
    """``budgets``: the section (``Settings(budgets=...)``) or ``budgets_file``. ``app``
    replaces the fake upstream. ``redis_url`` makes ``storage: redis`` count there."""

    def __init__(self, tmp_path: Path, *, app: ASGIApp | None = None, **settings: Any) -> None:
        super().__init__(tmp_path, **settings)
        gate = gate_for(self.guard)
        assert gate is not None, "give budgets= or budgets_file="
        self.gate: BudgetGate = gate
        if app is not None:
            self.inner = app
        self.app = StateAuth(SpendGuardMiddleware(self.inner, guard=self.guard, budgets=gate))

    @property
    def budgets(self) -> BudgetAdmin:
        return BudgetAdmin.of(self.gate, self.guard.ledger)

    async def __aexit__(self, *exc: object) -> None:
        await self.gate.aclose()
        await super().__aexit__(*exc)
