"""The model a gateway routes to is the one charged: the app's ``request.state.spendguard_model``
on the middleware's own path and on the ``Depends(spendguard_guard)`` path, and a LiteLLM
proxy's router (a stand-in module: LiteLLM itself runs in tests/compat) read by the middleware
at startup, with the deployment that served each response named by its header."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Request
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import STATE_MODEL, spendguard_guard
from spendguard.integrations.litellm import PROXY_MODULE
from spendguard.ledger.schema import records
from tests.support import MODEL, StateAuth, chat_body, client, lifespan, sql_rows

pytestmark = pytest.mark.anyio

ROUTED = "routed-model"  # 3 micro-USD per token; MODEL (the request's) costs 1
PRICES = {
    "as_of": "2026-11-01",
    "models": {
        MODEL: {"input": "1", "output": "1"},
        ROUTED: {"input": "3", "output": "3"},
        "default": {"input": "100", "output": "100"},  # an unknown model shows at once
    },
}


def settings(tmp_path: Path) -> Settings:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(PRICES))
    return Settings(database_url=f"sqlite:///{tmp_path / 'd.db'}", prices=path, run_worker=False)


async def provider(request: Request) -> JSONResponse:
    """Answers 10 prompt and 5 completion tokens, naming the request's model; routes to the
    model the body's ``x_route`` names, and says so the way the test asks."""
    body = await request.json()
    if "x_route" in body:
        request.state.spendguard_model = body["x_route"]
    usage = {"prompt_tokens": 10, "completion_tokens": 5}
    headers = {"x-litellm-model-id": body["x_id"]} if "x_id" in body else None
    return JSONResponse({"model": body["model"], "usage": usage}, headers=headers)


async def charged(guard: SpendGuard) -> list[tuple[str, int]]:
    """(model, estimate) of every record, sorted (records of one millisecond have no order)."""
    await guard.recorder.flush()
    url = guard.settings.database_url.get_secret_value()
    query = sa.select(records.c.model, records.c.estimate_micros)
    return sorted((m, e) for m, e in await sql_rows(url, query))


async def test_the_apps_routed_model_is_charged_on_the_middlewares_path(tmp_path: Path) -> None:
    guard = SpendGuard(settings(tmp_path))
    inner = Starlette(routes=[Route("/v1/chat/completions", provider, methods=["POST"])])
    app = StateAuth(SpendGuardMiddleware(inner, guard=guard))
    async with lifespan(app), client(app) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body(x_route=ROUTED))).is_success
        assert (await c.post("/v1/chat/completions", json=chat_body())).is_success
        unpriced = chat_body(x_route="not-in-the-table")
        assert (await c.post("/v1/chat/completions", json=unpriced)).is_success
        assert await charged(guard) == sorted([(ROUTED, 45), (MODEL, 15), (MODEL, 15)])
    assert STATE_MODEL == "spendguard_model"  # the name the app sets, documented


async def test_the_apps_routed_model_is_charged_on_the_depends_path(tmp_path: Path) -> None:
    guard = SpendGuard(settings(tmp_path))

    async def auth(request: Request) -> None:
        request.state.team_id, request.state.api_key_id = "acme", "alpha"

    app = FastAPI()
    app.post("/v1/chat/completions", dependencies=[Depends(auth), Depends(spendguard_guard)])(
        provider
    )
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    async with lifespan(app), client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(x_route=ROUTED))
        assert r.is_success and "x-spendguard-inference-id" in r.headers
        assert await charged(guard) == [(ROUTED, 45)]


# -- a LiteLLM proxy --------------------------------------------------------------------------


def deployment(name: str, model: str, ident: str, **info: Any) -> dict[str, Any]:
    return {
        "model_name": name,
        "litellm_params": {"model": model, "api_key": "sk-never-read"},
        "model_info": {"id": ident, **info},
    }


@pytest.fixture
def litellm_app(monkeypatch: pytest.MonkeyPatch) -> tuple[FastAPI, list[dict[str, Any]]]:
    """An app standing in for LiteLLM's: its module is loaded under LiteLLM's name, and its
    startup makes the router, as LiteLLM's does."""
    model_list: list[dict[str, Any]] = []
    module = ModuleType(PROXY_MODULE)

    @asynccontextmanager
    async def make_router(app: FastAPI) -> AsyncIterator[None]:
        model_list.extend(
            [
                deployment("team-gpt", f"openai/{ROUTED}", "plain"),
                deployment("team-mixed", f"openai/{ROUTED}", "list"),
                # 5 micro-USD per input token, 1 per output token (5e-06 and 1e-06 USD)
                deployment(
                    "team-mixed",
                    "azure/x",
                    "own",
                    input_cost_per_token=5e-06,
                    output_cost_per_token=1e-06,
                ),
            ]
        )
        module.llm_router = SimpleNamespace(model_list=model_list)  # type: ignore[attr-defined]
        yield

    app = FastAPI(lifespan=make_router)
    app.post("/v1/chat/completions")(provider)
    module.app = app  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, PROXY_MODULE, module)
    return app, model_list


async def test_a_litellm_alias_is_charged_as_the_deployment_that_served_it(
    tmp_path: Path, litellm_app: tuple[FastAPI, list[dict[str, Any]]]
) -> None:
    app, _ = litellm_app
    guard = SpendGuard(settings(tmp_path))
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    wrapped = StateAuth(app)
    async with lifespan(wrapped), client(wrapped) as c:
        for body in [
            chat_body(model="team-gpt", x_id="plain"),  # the response echoes the alias
            chat_body(model="team-mixed", x_id="list"),
            chat_body(model="team-mixed", x_id="own"),
            chat_body(model="team-mixed"),  # no header: the alias's dearest price
            chat_body(model="team-gpt", x_id="plain", x_route=MODEL),  # the app's word first
        ]:
            assert (await c.post("/v1/chat/completions", json=body)).is_success
        assert await charged(guard) == sorted(
            [
                (ROUTED, 45),
                (ROUTED, 45),
                ("team-mixed@own", 10 * 5 + 5 * 1),
                ("team-mixed", 10 * 5 + 5 * 3),  # each price the dearest of the two
                (MODEL, 15),
            ]
        )
    assert guard.prices.lookup("team-gpt") == guard.prices.lookup(ROUTED)


async def test_without_litellm_nothing_is_read(tmp_path: Path) -> None:
    guard = SpendGuard(settings(tmp_path))
    app = FastAPI()
    app.post("/v1/chat/completions")(provider)
    middleware = SpendGuardMiddleware(app, guard=guard)
    table = guard.prices
    async with lifespan(StateAuth(middleware)):
        assert middleware.litellm is None and guard.prices is table
