"""Tests for spendguard.asgi.wiring: the checks the middleware makes once, at the app's
lifespan startup or its first request, so that a setup mistake is logged, never silent."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route, WebSocketRoute

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import from_user, spendguard_guard
from spendguard.asgi.routes import RouteTable
from spendguard.asgi.wiring import app_routes, route_report, sample_path
from tests.support import StateAuth, chat_body, client, lifespan, upstream, write_unit_prices

pytestmark = pytest.mark.anyio


async def ok(request: Any) -> Any:
    return PlainTextResponse("ok")


def opaque(scope: Any, receive: Any, send: Any) -> Any:  # pragma: no cover - never called
    raise NotImplementedError


def settings(tmp_path: Path, **extra: Any) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'w.db'}", prices=write_unit_prices(tmp_path), **extra
    )


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- the app's routes --------------------------------------------------------------------------
def test_app_routes_walk_mounts_and_see_through_middleware() -> None:
    inner = Starlette(
        routes=[Route("/chat/completions", ok, methods=["POST"]), WebSocketRoute("/ws", ok)],
        middleware=[Middleware(StateAuth)],
    )
    app = Starlette(
        routes=[
            Route("/health", ok),
            Mount("/llm", app=inner),
            Mount("/raw", app=opaque),
            Mount("/wrapped", app=StateAuth(inner)),
        ]
    )
    found = {r.path: r.methods for r in app_routes(app) or []}
    assert found == {
        "/health": frozenset({"GET", "HEAD"}),
        "/llm/chat/completions": frozenset({"POST"}),
        "/raw/{path:path}": None,  # an app without routes: anything under its prefix
        "/wrapped/chat/completions": frozenset({"POST"}),
    }
    assert app_routes(StateAuth(app)) == app_routes(app)  # through a middleware around it
    assert app_routes(opaque) is None


def test_routes_with_the_guard_dependency_are_found() -> None:
    app = FastAPI()

    async def auth() -> None: ...

    app.post("/v1/chat/completions", dependencies=[Depends(auth), Depends(spendguard_guard)])(ok)
    app.post("/v1/embeddings", dependencies=[Depends(auth)])(ok)
    guarded = {r.path for r in app_routes(app) or [] if r.guarded}
    assert guarded == {"/v1/chat/completions"}


def test_route_report() -> None:
    app = FastAPI()
    app.post("/v1/chat/completions")(ok)
    app.post("/llm/v1/messages")(ok)
    app.post("/admin/limits")(ok)
    app.post("/other/completions", dependencies=[Depends(spendguard_guard)])(ok)
    report = route_report(RouteTable(["/v1/chat/completions", "/v1/embeddings"]), app_routes(app))
    assert report.unmatched == ("/v1/embeddings",)
    assert set(report.uncovered) == {"/llm/v1/messages", "/other/completions"}
    assert report.stray == ("/other/completions",)
    assert not report.ok


def test_sample_paths_fit_their_convertors() -> None:
    assert sample_path("/a/{x}/b/{n:int}/{f:float}/{rest:path}") == "/a/x/b/1/1.5/x"


# -- route warnings at startup ------------------------------------------------------------------
def gateway(app: Starlette, s: Settings) -> Any:
    return StateAuth(SpendGuardMiddleware(app, guard=SpendGuard(s)))


async def test_a_configured_route_the_app_does_not_serve_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "spendguard")
    app = Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"])])
    custom = settings(tmp_path, routes="/v1/chat/completions,/v1/chat/completion")  # a typo
    async with lifespan(gateway(app, custom)):
        pass
    assert any("match no POST route of the app: /v1/chat/completion " in m for m in warned(caplog))


async def test_default_routes_the_app_does_not_serve_are_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "spendguard")
    app = Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"])])
    async with lifespan(gateway(app, settings(tmp_path))):
        pass
    assert warned(caplog) == []
    guarded = [r.getMessage() for r in caplog.records if "guards these routes" in r.getMessage()]
    assert guarded == ["spendguard guards these routes of the app: /v1/chat/completions"]


async def test_an_unconfigured_inference_route_is_a_warning_on_the_first_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a lifespan the check runs on the first request, of any kind."""
    caplog.set_level(logging.WARNING, "spendguard")
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", ok, methods=["POST"]),
            Route("/v2/embeddings", ok, methods=["POST"]),
            Route("/health", ok),
        ]
    )
    async with client(gateway(app, settings(tmp_path))) as c:
        await c.get("/health")
        await c.get("/health")
    said = warned(caplog)
    assert len(said) == 1 and "are REFUSED (403): /v2/embeddings." in said[0]


async def test_where_the_ledger_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, "spendguard")
    app = Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"])])
    async with lifespan(gateway(app, settings(tmp_path))):
        pass
    assert f"spendguard ledger: SQLite file {tmp_path / 'w.db'}" in caplog.text
    assert warned(caplog) == []
    # The default file of the working directory: a warning, with the absolute path.
    caplog.clear()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPENDGUARD_DATABASE_URL", raising=False)
    async with lifespan(gateway(app, Settings(prices=write_unit_prices(tmp_path)))):
        pass
    said = warned(caplog)
    assert len(said) == 1 and f"SQLite file {tmp_path / 'spendguard.db'}" in said[0]
    assert "the default ./spendguard.db" in said[0]


# -- no lifespan ---------------------------------------------------------------------------------
async def test_without_lifespan_the_first_inference_starts_the_background_tasks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    guard = SpendGuard(settings(tmp_path, settle_interval=0.05))
    app = StateAuth(SpendGuardMiddleware(upstream(), guard=guard))
    try:
        async with client(app) as c:
            assert (await c.get("/health")).status_code == 200
            assert not guard.running  # other traffic starts nothing

            async def one() -> None:
                assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200

            async with anyio.create_task_group() as tg:  # concurrent first requests
                for _ in range(5):
                    tg.start_soon(one)
            assert guard.running
            with anyio.fail_after(10):  # the in-app worker settles them
                while await guard.ledger.charges_total() < 5 * 15:
                    await anyio.sleep(0.05)
    finally:
        await guard.stop()
    assert sum("never an ASGI lifespan" in m for m in warned(caplog)) == 1


async def test_with_a_lifespan_nothing_starts_on_requests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    guard = SpendGuard(settings(tmp_path))
    app = StateAuth(SpendGuardMiddleware(upstream(), guard=guard))
    async with lifespan(app), client(app) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    assert not guard.running  # stopped with the lifespan, and never started twice
    assert warned(caplog) == []


# -- no identity -----------------------------------------------------------------------------------
async def requests_without_identity(
    middleware: SpendGuardMiddleware, caplog: pytest.LogCaptureFixture, user: object = None
) -> list[str]:
    caplog.set_level(logging.WARNING, "spendguard")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if user is not None:
            scope["user"] = user
        await middleware(scope, receive, send)

    assert middleware.guard is not None
    await middleware.guard.start(worker=False)
    try:
        async with client(app) as c:
            for _ in range(3):
                r = await c.post("/v1/chat/completions", json=chat_body())
                assert r.status_code in (200, 401)
    finally:
        await middleware.guard.stop()
    return [m for m in warned(caplog) if "had no identity" in m]


async def test_the_first_request_without_identity_is_explained_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    said = await requests_without_identity(
        SpendGuardMiddleware(upstream(), settings(tmp_path)), caplog
    )
    assert len(said) == 1
    assert "was answered 401" in said[0]
    assert "request.state.team_id" in said[0] and "Depends(spendguard_guard)" in said[0]


async def test_a_user_without_the_names_is_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Member:
        is_authenticated = True
        org = "acme"
        key_name = "alpha"

    said = await requests_without_identity(
        SpendGuardMiddleware(upstream(), settings(tmp_path)), caplog, Member()
    )
    assert len(said) == 1
    assert "Member (attributes: is_authenticated, key_name, org)" in said[0]
    assert 'from_user(team="...", api_key="...")' in said[0]


async def test_a_resolver_finding_nothing_is_named_and_allow_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    middleware = SpendGuardMiddleware(
        upstream(),
        settings(tmp_path, missing_identity="allow"),
        resolve_identity=from_user(team="org"),
    )
    said = await requests_without_identity(middleware, caplog)
    assert len(said) == 1
    assert "passed through unlimited and unrecorded" in said[0]
    assert "resolve_identity=from_user(team='org', api_key=None) returned no identity" in said[0]


async def test_the_status_says_who_started_the_background_tasks(tmp_path: Path) -> None:
    with_lifespan = SpendGuardMiddleware(upstream(), guard=SpendGuard(settings(tmp_path)))
    assert with_lifespan.wiring.status()["checked"] is False
    async with lifespan(with_lifespan):
        assert with_lifespan.wiring.status() == {
            "checked": True,
            "background_started_by": "lifespan",
            "deferred_routes": [],
        }
    guard = SpendGuard(settings(tmp_path))
    without = SpendGuardMiddleware(upstream(), guard=guard)
    try:
        async with client(StateAuth(without)) as c:
            await c.post("/v1/chat/completions", json=chat_body())
        assert without.wiring.status()["background_started_by"] == "first request"
    finally:
        await guard.stop()


def test_routes_of_included_routers_are_found_with_their_prefixes() -> None:
    """FastAPI >= 0.137 keeps ``include_router`` as one node of ``app.routes``."""
    from fastapi import APIRouter

    async def auth() -> None: ...

    inner = APIRouter(prefix="/deployments")
    inner.post("/{model:path}/chat/completions")(ok)
    outer = APIRouter(prefix="/openai", dependencies=[Depends(auth), Depends(spendguard_guard)])
    outer.post("/v1/chat/completions")(ok)
    outer.include_router(inner)
    app = FastAPI()
    app.include_router(outer)
    app.post("/v1/embeddings")(ok)
    found = {r.path: (r.methods, r.guarded) for r in app_routes(app) or []}
    assert found["/openai/v1/chat/completions"] == (frozenset({"POST"}), True)
    assert found["/openai/deployments/{model:path}/chat/completions"] == (
        frozenset({"POST"}),
        True,
    )
    assert found["/v1/embeddings"] == (frozenset({"POST"}), False)


async def test_routes_the_app_adds_in_its_lifespan_are_checked_after_it_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")

    @contextlib.asynccontextmanager
    async def adds_routes(app: Starlette) -> AsyncIterator[None]:
        app.router.routes.append(Route("/v3/embeddings", ok, methods=["POST"]))
        yield

    app = Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"])])
    app.router.lifespan_context = adds_routes
    async with lifespan(gateway(app, settings(tmp_path))):
        pass
    said = warned(caplog)
    assert len(said) == 1 and "REFUSED (403): /v3/embeddings." in said[0]
