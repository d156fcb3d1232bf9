"""An admin endpoint of your own in the gateway: spendguard's admin API behind a FastAPI route.

Meant to be copied. It wants ``Authorization: Bearer $ADMIN_TOKEN`` (unset: the route answers
404), and it answers bad input with a 4xx naming the problem, never a 500::

    ADMIN_TOKEN=change-me uvicorn examples.admin_api:app --port 8000
    curl -X PUT -H 'authorization: Bearer change-me' -H 'content-type: application/json' \\
      -d '{"limit_usd": "5"}' localhost:8000/admin/teams/acme/limits/day

spendguard ships the same operations, and more, as a mountable app: ``spendguard.asgi.admin_app``
(docs/admin-http.md).
"""

from __future__ import annotations

import hmac
import os
from decimal import Decimal
from typing import Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, Field

from spendguard import SpendGuard, SpendGuardError, SpendGuardMiddleware
from spendguard.engine.views import usage_json

guard = SpendGuard()  # settings from SPENDGUARD_* env vars
app = FastAPI()
app.add_middleware(SpendGuardMiddleware, guard=guard)
TOKEN = os.environ.get("ADMIN_TOKEN", "")


def admin(authorization: str = Header("")) -> None:
    if not TOKEN:  # no token configured: the admin route does not exist
        raise HTTPException(404)
    # Constant time: a timing difference must not reveal how much of a guess was right.
    if not hmac.compare_digest(authorization.encode(), f"Bearer {TOKEN}".encode()):
        raise HTTPException(401, "admin bearer token required", {"WWW-Authenticate": "Bearer"})


class Limit(BaseModel):
    # The bounds spendguard enforces, checked here so a bad amount is a 422 naming the field.
    limit_usd: Decimal = Field(ge=0, le=1_000_000_000, decimal_places=6, allow_inf_nan=False)
    mode: Literal["soft", "hard"] = "soft"


@app.put("/admin/teams/{team}/limits/{window}", dependencies=[Depends(admin)])
async def set_limit(
    team: str, window: Literal["day", "month"], limit: Limit, api_key: str | None = None
) -> dict[str, Any]:
    try:
        await guard.admin.set_policy(
            team, api_key, window=window, limit_usd=limit.limit_usd, hard=limit.mode == "hard"
        )
        usage = await guard.admin.usage(team, api_key)  # spend, limit, remaining, reset time
    except ValueError as exc:  # what the admin API refuses (an empty key id, say)
        raise HTTPException(422, str(exc)) from exc
    except SpendGuardError as exc:  # the ledger or the store can't be reached: retry later
        raise HTTPException(503, str(exc)) from exc
    return usage_json(usage, api_key)
