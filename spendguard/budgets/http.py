"""Budget admin routes a gateway can mount: ``GET /admin/budgets`` (effective config and each
scope x window's counters) and ``POST /admin/budgets/reset``, behind a bearer token of their own
(compared in constant time)::

    app.mount("/admin", budget_admin_app(gate, token=os.environ["ADMIN_TOKEN"], ledger=...))

The reset body: ``{"scope": "per_api_key" | "per_model" | "global", "window"?, "team_id"?,
"api_key_id"? (per-key only), "model"? (per-model only)}``.
"""

from __future__ import annotations

import hmac
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ledger import Ledger
from .admin import BudgetAdmin
from .gate import BudgetGate


def budget_admin_app(gate: BudgetGate, *, token: str, ledger: Ledger | None = None) -> Starlette:
    if not token:
        raise ValueError("the budget admin routes need a non-empty token")
    expected = f"Bearer {token}".encode()

    def authorized(request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, expected)

    def forbidden() -> Response:
        return JSONResponse({"error": "unauthorized"}, status_code=401)

    async def inspect(request: Request) -> Response:
        if not authorized(request):
            return forbidden()
        report = await BudgetAdmin.of(gate, ledger).inspect()
        return JSONResponse(report.as_json())

    async def reset(request: Request) -> Response:
        if not authorized(request):
            return forbidden()
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or set(body) - {
                "scope",
                "window",
                "team_id",
                "api_key_id",
                "model",
            }:
                raise ValueError("fields: scope, window, team_id, api_key_id, model")
            n = await BudgetAdmin.of(gate, ledger).reset(
                body.get("scope", ""),
                window=body.get("window"),
                team_id=body.get("team_id"),
                api_key_id=body.get("api_key_id"),
                model=body.get("model"),
            )
        except ValueError as exc:  # JSON errors and bad fields alike
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"reset": n})

    return Starlette(
        routes=[
            Route("/budgets", inspect, methods=["GET"]),
            Route("/budgets/reset", reset, methods=["POST"]),
        ]
    )
