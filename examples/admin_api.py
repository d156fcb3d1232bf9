"""The README's admin endpoint: spendguard's admin API behind a FastAPI route of the gateway."""

from decimal import Decimal

from fastapi import FastAPI

from spendguard import SpendGuard, SpendGuardMiddleware

guard = SpendGuard()  # settings from SPENDGUARD_* env vars
app = FastAPI()
app.add_middleware(SpendGuardMiddleware, guard=guard)


@app.put("/admin/teams/{team}/limits/{window}")  # window: "day" or "month"
async def set_limit(team: str, window: str, usd: Decimal, api_key: str | None = None) -> dict:
    await guard.admin.set_policy(team, api_key, window=window, limit_usd=usd)
    usage = await guard.admin.usage(team, api_key)  # spend, limit, remaining, reset time
    return {"limits": [(u.limit.window, u.amount, u.remaining, u.resets_at) for u in usage.limits]}
