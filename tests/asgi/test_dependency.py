"""Tests for spendguard.asgi.dependency and spendguard.asgi.deferred: admission after the app's
own auth dependency (FastAPI ``Depends``), on the embedded store and a real SQLite ledger."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from starlette.responses import JSONResponse

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import spendguard_guard
from spendguard.limits import Period
from tests.support import MODEL, StateAuth, chat_body, client, lifespan, write_unit_prices
from tests.support.budgets import section

pytestmark = pytest.mark.anyio

KEYS = {"sk-alpha": ("acme", "alpha")}


class Provider:
    """The endpoint: answers like a provider, counting calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, request: Request) -> JSONResponse:
        self.calls += 1
        body = await request.json()
        usage = {"prompt_tokens": 10, "completion_tokens": 5}
        return JSONResponse({"object": "chat.completion", "model": body["model"], "usage": usage})


async def auth(request: Request, authorization: str = Header("")) -> None:
    found = KEYS.get(authorization.removeprefix("Bearer "))
    if found is None:
        raise HTTPException(401, "unknown key")  # the app's own format: {"detail": ...}
    request.state.team_id, request.state.api_key_id = found


def build(guard: SpendGuard, provider: Provider, *dependencies: Any) -> FastAPI:
    app = FastAPI()
    app.post("/v1/chat/completions", dependencies=[Depends(d) for d in dependencies])(provider)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    return app


@pytest.fixture
async def guard(tmp_path: Path) -> AsyncIterator[SpendGuard]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'd.db'}",
        prices=write_unit_prices(tmp_path),
        run_worker=False,
    )
    yield SpendGuard(settings)


ALPHA = {"authorization": "Bearer sk-alpha"}


async def test_admitted_after_the_auth_dependency_and_charged_once(guard: SpendGuard) -> None:
    provider = Provider()
    app = build(guard, provider, auth, spendguard_guard)
    async with lifespan(app), client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        assert r.status_code == 200 and "x-spendguard-inference-id" in r.headers
        await guard.recorder.flush()
        assert await guard.ledger.unsettled() == (1, 15)


async def test_a_refusal_never_reaches_the_endpoint(guard: SpendGuard) -> None:
    provider = Provider()
    app = build(guard, provider, auth, spendguard_guard)
    async with lifespan(app), client(app) as c:
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=0)
        r = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.json()["error"]["message"] == "API Key daily spend limit exceeded."
        assert provider.calls == 0
        await guard.recorder.flush()
        assert await guard.ledger.unsettled() == (0, 0)


async def test_a_bad_key_gets_the_apps_own_answer_and_costs_nothing(guard: SpendGuard) -> None:
    provider = Provider()
    app = build(guard, provider, auth, spendguard_guard)
    async with lifespan(app), client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(), headers={"authorization": "x"})
        assert r.status_code == 401 and r.json() == {"detail": "unknown key"}
        assert "x-spendguard-inference-id" not in r.headers
        await guard.recorder.flush()
        assert await guard.ledger.unsettled() == (0, 0)


async def test_a_bad_body_is_refused_in_the_routes_format_after_auth(guard: SpendGuard) -> None:
    provider = Provider()
    app = build(guard, provider, auth, spendguard_guard)
    async with lifespan(app), client(app) as c:
        # FastAPI reads the body itself; spendguard's checks come with the dependency.
        r = await c.post("/v1/chat/completions", json={"model": 5}, headers=ALPHA)
        assert r.status_code == 400 and r.json()["error"]["message"] == "'model' must be a string."
        assert provider.calls == 0


async def test_an_auth_dependency_that_stores_nothing_is_a_401_and_explained(
    guard: SpendGuard, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")

    async def forgetful_auth() -> None:
        pass

    provider = Provider()
    app = build(guard, provider, forgetful_auth, spendguard_guard)
    async with lifespan(app), client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_identity"
    assert provider.calls == 0
    assert "had no identity" in caplog.text


async def test_listed_twice_or_after_a_middleware_identity_admits_once(guard: SpendGuard) -> None:
    provider = Provider()
    twice = build(guard, provider, auth, spendguard_guard, spendguard_guard)
    # An auth middleware already gave the identity: the middleware admits before the app and
    # the dependency has nothing left to do.
    both = StateAuth(build(guard, provider, spendguard_guard))
    async with lifespan(twice):
        async with client(twice) as c:
            assert (
                await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
            ).is_success
        async with client(both) as c:
            assert (await c.post("/v1/chat/completions", json=chat_body())).is_success
        await guard.recorder.flush()
        assert await guard.ledger.unsettled() == (2, 30)


async def test_the_dependency_without_the_middleware_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    provider = Provider()
    app = FastAPI()
    app.post("/v1/chat/completions", dependencies=[Depends(spendguard_guard)])(provider)
    async with client(app) as c:
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json={"model": MODEL})
            assert r.status_code == 200
    said = [r.getMessage() for r in caplog.records if "no SpendGuardMiddleware" in r.getMessage()]
    assert len(said) == 1 and "NOT limited or recorded" in said[0]


async def test_budgets_hold_on_the_deferred_path_too(tmp_path: Path) -> None:
    """A budget of 100 tokens a key: the first request reserves its estimate (2 + 98) and uses
    15; the second's estimate no longer fits and is refused before the endpoint."""
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'b.db'}",
        prices=write_unit_prices(tmp_path),
        run_worker=False,
        budgets=section(scopes={"per_api_key": {"tokens": 100}}),
    )
    guard, provider = SpendGuard(settings), Provider()
    app = build(guard, provider, auth, spendguard_guard)
    async with lifespan(app), client(app) as c:
        body = chat_body(max_tokens=98)
        assert (await c.post("/v1/chat/completions", json=body, headers=ALPHA)).is_success
        denied = await c.post("/v1/chat/completions", json=body, headers=ALPHA)
    assert denied.status_code == 429 and denied.json()["error"]["code"] == "budget_exceeded"
    assert provider.calls == 1
