"""Tests for spendguard.asgi.dependency and spendguard.asgi.deferred: admission after the app's
own auth dependency (FastAPI ``Depends``), on the embedded store and a real SQLite ledger."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from starlette.responses import JSONResponse

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import spendguard_guard
from spendguard.ledger.schema import records
from spendguard.limits import Period
from tests.support import (
    MODEL,
    StateAuth,
    chat_body,
    client,
    lifespan,
    sql_rows,
    write_unit_prices,
)
from tests.support.budgets import section

pytestmark = pytest.mark.anyio

KEYS = {"sk-alpha": ("acme", "alpha"), "sk-beta": ("acme", "beta")}


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
BETA = {"authorization": "Bearer sk-beta"}


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
        message = r.json()["error"]["message"]
        assert message.startswith("API Key daily spend limit exceeded: limit $0.00, resets at ")
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
    # The route already lists the dependency: the explanation points at the auth dependency
    # before it, not at adding a Depends(spendguard_guard) that is there.
    assert "the dependencies before it left no identity" in caplog.text
    assert "add Depends(spendguard_guard)" not in caplog.text


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


# -- the recipe through include_router ------------------------------------------------------
# FastAPI >= 0.137 keeps an included router as one node of app.routes; the routes it serves,
# with the include's prefixes and dependencies, are only visible through it.

GUARDED = [Depends(auth), Depends(spendguard_guard)]


def router_dependencies(provider: Provider) -> tuple[FastAPI, str]:
    """docs/getting-started.md's recipe: the dependencies on the router, the router included."""
    router = APIRouter(dependencies=GUARDED)
    router.post("/v1/chat/completions")(provider)
    app = FastAPI()
    app.include_router(router)
    return app, "/v1/chat/completions"


def include_dependencies(provider: Provider) -> tuple[FastAPI, str]:
    """The dependencies given to include_router() rather than to the router."""
    router = APIRouter()
    router.post("/chat/completions")(provider)
    app = FastAPI()
    app.include_router(router, prefix="/v1", dependencies=GUARDED)
    return app, "/v1/chat/completions"


def nested_prefixes(provider: Provider) -> tuple[FastAPI, str]:
    """Three routers deep, a prefix at every level: auth on the outer router, the guard on the
    inner include (FastAPI runs the outer dependencies first)."""
    inner = APIRouter(prefix="/v1")
    inner.post("/chat/completions")(provider)
    outer = APIRouter(prefix="/gw", dependencies=[Depends(auth)])
    outer.include_router(inner, prefix="/team", dependencies=[Depends(spendguard_guard)])
    app = FastAPI()
    app.include_router(outer, prefix="/api")
    return app, "/api/gw/team/v1/chat/completions"


def route_dependencies(provider: Provider) -> tuple[FastAPI, str]:
    """The dependencies on the route itself, inside an included router, beside an unguarded
    route of the same router."""
    router = APIRouter(prefix="/llm")
    router.post("/v1/chat/completions", dependencies=GUARDED)(provider)
    router.get("/v1/models")(lambda: {"data": []})
    app = FastAPI()
    app.include_router(router, prefix="/team")
    return app, "/team/llm/v1/chat/completions"


SHAPES = [router_dependencies, include_dependencies, nested_prefixes, route_dependencies]


class Included:
    def __init__(self, app: FastAPI, path: str, guard: SpendGuard, provider: Provider) -> None:
        self.app, self.path, self.guard, self.provider = app, path, guard, provider


def included(shape: Callable[[Provider], tuple[FastAPI, str]], tmp_path: Path) -> Included:
    provider = Provider()
    app, path = shape(provider)
    guard = make_guard(tmp_path, path)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    return Included(app, path, guard, provider)


def make_guard(tmp_path: Path, *routes: str) -> SpendGuard:
    """A guard on a SQLite file in ``tmp_path``, guarding exactly ``routes``."""
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'd.db'}",
        prices=write_unit_prices(tmp_path),
        run_worker=False,
        routes=routes,
    )
    return SpendGuard(settings)


async def recorded(guard: SpendGuard) -> list[tuple[Any, ...]]:
    """The inference records the ledger holds, read on a connection of the test's own."""
    await guard.recorder.flush()
    query = sa.select(
        records.c.team_id,
        records.c.api_key_id,
        records.c.route,
        records.c.model,
        records.c.status_code,
        records.c.input_tokens,
        records.c.output_tokens,
    )
    return await sql_rows(guard.settings.database_url.get_secret_value(), query)


@pytest.mark.parametrize("shape", SHAPES)
async def test_included_routes_admit_a_valid_key_and_charge_it(
    shape: Callable[[Provider], tuple[FastAPI, str]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "spendguard")
    gw = included(shape, tmp_path)
    async with lifespan(gw.app), client(gw.app) as c:
        r = await c.post(gw.path, json=chat_body(), headers=ALPHA)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 10, "completion_tokens": 5}
        assert "x-spendguard-inference-id" in r.headers
        assert gw.provider.calls == 1
        assert await recorded(gw.guard) == [("acme", "alpha", gw.path, MODEL, 200, 10, 5)]
        assert await gw.guard.ledger.unsettled() == (1, 15)
    # The startup check found the included route and knows it waits for the dependency.
    assert f"spendguard guards these routes of the app: {gw.path}" in caplog.text
    assert "had no identity" not in caplog.text


@pytest.mark.parametrize("shape", SHAPES)
async def test_included_routes_leave_a_bad_key_to_the_apps_auth(
    shape: Callable[[Provider], tuple[FastAPI, str]], tmp_path: Path
) -> None:
    gw = included(shape, tmp_path)
    async with lifespan(gw.app), client(gw.app) as c:
        for headers in ({"authorization": "Bearer sk-nobody"}, {}):
            r = await c.post(gw.path, json=chat_body(), headers=headers)
            assert r.status_code == 401 and r.json() == {"detail": "unknown key"}
            assert not any(name.startswith("x-spendguard") for name in r.headers)
        assert gw.provider.calls == 0
        assert await recorded(gw.guard) == []
        assert await gw.guard.ledger.unsettled() == (0, 0)


@pytest.mark.parametrize("shape", SHAPES)
async def test_included_routes_refuse_a_key_over_its_limit(
    shape: Callable[[Provider], tuple[FastAPI, str]], tmp_path: Path
) -> None:
    gw = included(shape, tmp_path)
    async with lifespan(gw.app), client(gw.app) as c:
        await gw.guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=0)
        r = await c.post(gw.path, json=chat_body(), headers=ALPHA)
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.headers["x-should-retry"] == "false"
        error = r.json()["error"]
        assert error.pop("message").startswith("API Key daily spend limit exceeded: limit $0.00")
        assert error == {"type": "insufficient_quota", "code": "spend_limit_exceeded"}
        # Another key of the same team has no limit: still admitted on the same route.
        other = await c.post(gw.path, json=chat_body(), headers=BETA)
        assert other.status_code == 200
        assert gw.provider.calls == 1
        assert await recorded(gw.guard) == [("acme", "beta", gw.path, MODEL, 200, 10, 5)]


# -- routes the app adds after the middleware's startup check ----------------------------------
def no_depends_advice(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing logged tells the user to add the Depends(spendguard_guard) the route has."""
    said = [r.getMessage() for r in caplog.records if r.name == "spendguard"]
    assert not [m for m in said if "add Depends(spendguard_guard)" in m or "no identity" in m]


def add_to_app(app: FastAPI, router: APIRouter, provider: Provider) -> None:
    app.post("/v1/chat/completions", dependencies=GUARDED)(provider)


def include_later(app: FastAPI, router: APIRouter, provider: Provider) -> None:
    late = APIRouter(prefix="/v1", dependencies=GUARDED)
    late.post("/chat/completions")(provider)
    app.include_router(late)


def add_to_included_router(app: FastAPI, router: APIRouter, provider: Provider) -> None:
    # The router was included (empty) before the app started; the route joins it now.
    router.post("/chat/completions")(provider)


@pytest.mark.parametrize("add", [add_to_app, include_later, add_to_included_router])
async def test_a_route_added_after_startup_is_admitted_by_its_dependency(
    add: Callable[[FastAPI, APIRouter, Provider], None],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "spendguard")
    guard, provider = make_guard(tmp_path, "/v1/chat/completions"), Provider()
    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})
    router = APIRouter(prefix="/v1", dependencies=GUARDED)
    app.include_router(router)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    async with lifespan(app), client(app) as c:
        assert (await c.get("/health")).status_code == 200  # serving, without the route
        add(app, router, provider)  # lazily, as an app registering a route on first use
        r = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        assert r.status_code == 200, r.text
        assert "x-spendguard-inference-id" in r.headers
        assert await recorded(guard) == [
            ("acme", "alpha", "/v1/chat/completions", MODEL, 200, 10, 5)
        ]
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=0)
        r = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        assert r.status_code == 429 and r.json()["error"]["code"] == "spend_limit_exceeded"
        bad = await c.post("/v1/chat/completions", json=chat_body(), headers={"authorization": "x"})
        assert bad.status_code == 401 and bad.json() == {"detail": "unknown key"}
    assert provider.calls == 1
    no_depends_advice(caplog)


async def test_routes_added_in_the_apps_lifespan_are_admitted_by_their_dependency(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "spendguard")
    guard, provider = make_guard(tmp_path, "/v1/chat/completions"), Provider()

    @asynccontextmanager
    async def app_lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Routes that exist only once the app has started (a plugin loaded at startup).
        router = APIRouter(dependencies=GUARDED)
        router.post("/chat/completions")(provider)
        app.include_router(router, prefix="/v1")
        yield

    app = FastAPI(lifespan=app_lifespan)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    async with lifespan(app), client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        assert r.status_code == 200, r.text
        assert await recorded(guard) == [
            ("acme", "alpha", "/v1/chat/completions", MODEL, 200, 10, 5)
        ]
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=0)
        r = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        assert r.status_code == 429 and r.json()["error"]["code"] == "spend_limit_exceeded"
    assert provider.calls == 1
    no_depends_advice(caplog)
    # The app's startup check ran on the app as started: nothing is wrong, nothing is warned.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "spendguard guards these routes of the app: /v1/chat/completions" in caplog.text
