"""Three gateways written from scratch as a newcomer writes them, each driven by the official
``openai`` SDK: FastAPI with ``Depends`` auth, Starlette with ``AuthenticationMiddleware``, and a
gateway mounted under a prefix with routes of its own. Each limits correctly, and each of its
mis-configurations is logged, never silent."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard import Identity, Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import from_user, spendguard_guard
from spendguard.testing import fake_upstream
from spendguard.testing.upstream import FakeUpstream
from tests.support import lifespan

pytestmark = pytest.mark.anyio

KEYS = {"sk-alpha": ("acme", "alpha"), "sk-beta": ("acme", "beta")}
MESSAGES: Any = [{"role": "user", "content": "How much is left in the budget?"}]
ONE_MICRO = "0.000001"  # the first inference fits under it, the second is refused


def settings(tmp_path: Path, **extra: Any) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path / 'ledger.db'}", **extra)


def proxy(upstream: FakeUpstream, path: str = "/v1/chat/completions") -> Callable[..., Any]:
    """The gateway's endpoint: forward the body to the provider, answer what it answered."""

    async def endpoint(request: Request) -> Response:
        transport = httpx.ASGITransport(app=upstream)
        async with httpx.AsyncClient(transport=transport, base_url="http://provider") as client:
            answer = await client.post(path, content=await request.body())
        media_type = answer.headers.get("content-type")
        return Response(answer.content, answer.status_code, media_type=media_type)

    return endpoint


def sdk(app: ASGIApp, base_url: str, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, http_client=http, max_retries=0)


async def chat(client: openai.AsyncOpenAI) -> Any:
    return await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)


async def limit_is_enforced(guard: SpendGuard, first: Any, second: Any) -> None:
    """``first`` and ``second`` each make one inference as key beta, limited to 1 micro-USD a
    day: the first is served and charged, the second refused with spendguard's 429."""
    await guard.admin.set_policy("acme", "beta", window="day", limit_usd=ONE_MICRO)
    reply = await first()
    assert reply.usage.total_tokens > 0
    with pytest.raises(openai.RateLimitError) as denied:
        await second()
    assert denied.value.response.json()["error"]["code"] == "spend_limit_exceeded"
    # Settled: by this pass, or by the in-app worker's if it was running at the same moment.
    await guard.recorder.flush()
    await guard.worker.run_once()
    with anyio.fail_after(10):
        while not await guard.ledger.charges_total(Identity("acme").team):
            await anyio.sleep(0.05)


def warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# -- 1. FastAPI, auth as a dependency ----------------------------------------------------------
class Lookups:
    """The gateway's key store, counting lookups."""

    def __init__(self) -> None:
        self.count = 0

    def find(self, authorization: str) -> tuple[str, str] | None:
        self.count += 1
        return KEYS.get(authorization.removeprefix("Bearer "))


def fastapi_gateway(
    guard: SpendGuard, upstream: FakeUpstream, lookups: Lookups, *, with_guard: bool = True
) -> FastAPI:
    async def auth(request: Request, authorization: str = Header("")) -> tuple[str, str]:
        found = lookups.find(authorization)
        if found is None:  # the app's own error format for a bad key
            raise HTTPException(401, {"error": {"code": "bad_key", "message": "Who are you?"}})
        request.state.team_id, request.state.api_key_id = found
        return found

    checks = [Depends(auth), Depends(spendguard_guard)] if with_guard else [Depends(auth)]
    app = FastAPI()
    app.post("/v1/chat/completions", dependencies=checks)(proxy(upstream))
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    return app


async def test_fastapi_depends_auth_limits_once_per_request(tmp_path: Path) -> None:
    guard, upstream, lookups = SpendGuard(settings(tmp_path)), fake_upstream(), Lookups()
    app = fastapi_gateway(guard, upstream, lookups)
    async with lifespan(app):
        beta = sdk(app, "http://gw/v1", "sk-beta")
        await limit_is_enforced(guard, lambda: chat(beta), lambda: chat(beta))
        assert upstream.request_count == 1  # the refused one never reached the provider
        assert lookups.count == 2  # the key was looked up once per request

        with pytest.raises(openai.AuthenticationError) as bad:
            await chat(sdk(app, "http://gw/v1", "sk-nobody"))
        # The app's own answer to a bad key, not spendguard's.
        assert bad.value.response.json() == {
            "detail": {"error": {"code": "bad_key", "message": "Who are you?"}}
        }
        assert lookups.count == 3 and upstream.request_count == 1


async def test_fastapi_depends_auth_without_the_guard_is_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    guard, upstream = SpendGuard(settings(tmp_path)), fake_upstream()
    app = fastapi_gateway(guard, upstream, Lookups(), with_guard=False)
    async with lifespan(app):
        with pytest.raises(openai.AuthenticationError):
            await chat(sdk(app, "http://gw/v1", "sk-beta"))
    assert "had no identity" in warnings(caplog)
    assert "Depends(spendguard_guard)" in warnings(caplog)


# -- 2. Starlette, AuthenticationMiddleware with a user of its own --------------------------
class Caller(BaseUser):
    """The gateway's user: its attributes are not spendguard's names."""

    def __init__(self, org: str, key_name: str) -> None:
        self.org, self.key_name = org, key_name

    @property
    def is_authenticated(self) -> bool:
        return True


class BearerBackend(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        found = KEYS.get(conn.headers.get("authorization", "").removeprefix("Bearer "))
        return None if found is None else (AuthCredentials(["llm"]), Caller(*found))


def starlette_gateway(guard: SpendGuard, upstream: FakeUpstream, **spendguard: Any) -> Starlette:
    return Starlette(
        routes=[Route("/v1/chat/completions", proxy(upstream), methods=["POST"])],
        middleware=[  # the first listed runs first
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(SpendGuardMiddleware, guard=guard, **spendguard),
        ],
    )


async def test_starlette_authentication_middleware_with_mapped_user(tmp_path: Path) -> None:
    guard, upstream = SpendGuard(settings(tmp_path)), fake_upstream()
    resolver = from_user(team="org", api_key="key_name")
    app = starlette_gateway(guard, upstream, resolve_identity=resolver)
    async with lifespan(app):
        beta = sdk(app, "http://gw/v1", "sk-beta")
        await limit_is_enforced(guard, lambda: chat(beta), lambda: chat(beta))
        assert upstream.request_count == 1
        await chat(sdk(app, "http://gw/v1", "sk-alpha"))  # another key, not limited
        assert upstream.request_count == 2


async def test_starlette_user_with_other_names_is_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    guard, upstream = SpendGuard(settings(tmp_path)), fake_upstream()
    app = starlette_gateway(guard, upstream)
    async with lifespan(app):
        with pytest.raises(openai.AuthenticationError):
            await chat(sdk(app, "http://gw/v1", "sk-beta"))
    said = warnings(caplog)
    assert "Caller" in said and "key_name" in said and "from_user(" in said


# -- 3. Mounted under a prefix, routes without /v1 --------------------------------------------
class StateAuth:
    """The gateway's auth middleware: bearer (OpenAI SDK) or api-key (Azure SDK) header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            token = headers.get(b"authorization", b"").decode().removeprefix("Bearer ")
            found = KEYS.get(token or headers.get(b"api-key", b"").decode())
            if found is not None:
                scope.setdefault("state", {})["team_id"], scope["state"]["api_key_id"] = found
        await self.app(scope, receive, send)


MOUNTED_ROUTES = "/llm/chat/completions,/llm/openai/deployments/{deployment}/chat/completions"


def llm_app(upstream: FakeUpstream, *middleware: Middleware) -> Starlette:
    endpoint = proxy(upstream)
    return Starlette(
        routes=[
            Route("/chat/completions", endpoint, methods=["POST"]),
            Route("/openai/deployments/{deployment}/chat/completions", endpoint, methods=["POST"]),
        ],
        middleware=list(middleware),
    )


def mounted_gateway(guard: SpendGuard, upstream: FakeUpstream) -> Starlette:
    """spendguard on the top app, with the mount's prefix in its routes."""
    return Starlette(
        routes=[Mount("/llm", app=llm_app(upstream))],
        middleware=[Middleware(StateAuth), Middleware(SpendGuardMiddleware, guard=guard)],
    )


async def test_mounted_gateway_with_prefixed_and_parametrised_routes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    guard = SpendGuard(settings(tmp_path, routes=MOUNTED_ROUTES))
    upstream = fake_upstream()
    app = mounted_gateway(guard, upstream)
    async with lifespan(app):
        beta = sdk(app, "http://gw/llm", "sk-beta")
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        azure = openai.AsyncAzureOpenAI(
            azure_endpoint="http://gw/llm",
            api_key="sk-beta",
            api_version="2024-10-21",
            http_client=http,
            max_retries=0,
        )
        # The plain route first, then the Azure-style route with its deployment parameter:
        # both count against the same key's limit.
        await limit_is_enforced(guard, lambda: chat(beta), lambda: chat(azure))
        with pytest.raises(openai.RateLimitError):
            await chat(beta)
        assert upstream.request_count == 1
    assert not warnings(caplog)  # correctly configured: nothing to warn about


async def test_mounted_gateway_with_default_routes_is_guarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The defaults guard a chat route under any prefix: a gateway mounted at /llm needs no
    SPENDGUARD_ROUTES, and the start-up check says which routes it guards."""
    caplog.set_level(logging.INFO, "spendguard")
    guard = SpendGuard(settings(tmp_path))  # the default routes
    app = mounted_gateway(guard, fake_upstream())
    async with lifespan(app):
        pass
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    guarded = [r.getMessage() for r in caplog.records if "guards these routes" in r.getMessage()]
    assert guarded == [
        "spendguard guards these routes of the app: /llm/chat/completions, "
        "/llm/openai/deployments/{deployment}/chat/completions"
    ]


async def test_middleware_on_the_mounted_app_starts_without_lifespan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    guard = SpendGuard(settings(tmp_path, routes="/chat/completions", settle_interval=0.05))
    upstream = fake_upstream()
    inner = llm_app(upstream, Middleware(StateAuth), Middleware(SpendGuardMiddleware, guard=guard))
    app = Starlette(routes=[Mount("/llm", app=inner)])
    try:
        async with lifespan(app):  # the top app's lifespan never reaches the mounted app
            assert not guard.running
            beta = sdk(app, "http://gw/llm", "sk-beta")
            await chat(beta)
            await chat(beta)
            assert guard.running
            # The worker runs: the records get settled without anyone asking.
            with anyio.fail_after(10):
                while await guard.ledger.charges_total() == 0:
                    await anyio.sleep(0.05)
    finally:
        await guard.stop()
    said = warnings(caplog)
    assert said.count("never an ASGI lifespan") == 1
