"""One admission for both paths (spendguard.asgi.admission): the same inference gets the same
answer whether its identity is known to the middleware (an auth middleware in front of it sets
``request.state``) or found inside the app by a FastAPI auth dependency followed by
``Depends(spendguard_guard)``.

Each outcome runs on two gateways built alike, each on its own SQLite file, its own embedded
store and the same fixed clock, so every value the answer carries (remaining spend, rate
counters, resets, budget levels) is the same on both paths; only the inference id differs
between requests by design.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Header, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import spendguard_guard
from spendguard.errors import StoreUnavailable
from spendguard.ledger.schema import records
from spendguard.limits import Period
from spendguard.store.memory import MemoryStore
from tests.support import (
    Clock,
    Override,
    chat_body,
    client,
    lifespan,
    sql_rows,
    write_unit_prices,
)
from tests.support.budgets import section

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"
KEYS = {"sk-alpha": ("acme", "alpha")}
ALPHA = {"authorization": "Bearer sk-alpha"}
INFERENCE_ID = "x-spendguard-inference-id"
USAGE = {"prompt_tokens": 10, "completion_tokens": 5}


# -- the app ------------------------------------------------------------------------------------
async def provider(request: Request) -> Response:
    """The endpoint: a provider's answer, streamed when asked; ``x_status`` breaks it."""
    body = await request.json()
    if body.get("x_status"):
        return JSONResponse({"error": {"message": "upstream broke"}}, body["x_status"])
    if not body.get("stream"):
        return JSONResponse({"object": "chat.completion", "model": body["model"], "usage": USAGE})

    async def events() -> AsyncIterator[bytes]:
        for word in ("a ", "b "):
            yield f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n".encode()
        yield f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def lookup(authorization: str) -> tuple[str, str] | None:
    return KEYS.get(authorization.removeprefix("Bearer "))


class HeaderAuth:
    """The host's auth as a middleware in front of spendguard: the key's identity goes into
    ``request.state``; an unknown key leaves it empty."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            found = lookup(dict(scope["headers"]).get(b"authorization", b"").decode())
            if found is not None:
                state = scope.setdefault("state", {})
                state["team_id"], state["api_key_id"] = found
        await self.app(scope, receive, send)


async def auth(request: Request, authorization: str = Header("")) -> None:
    """The same auth as a FastAPI dependency, run inside the app after every middleware."""
    found = lookup(authorization)
    if found is not None:
        request.state.team_id, request.state.api_key_id = found


def middleware_path(guard: SpendGuard) -> FastAPI:
    app = FastAPI()
    app.post(PATH)(provider)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    app.add_middleware(HeaderAuth)  # added last: runs first, before spendguard
    return app


def depends_path(guard: SpendGuard) -> FastAPI:
    app = FastAPI()
    app.post(PATH, dependencies=[Depends(auth), Depends(spendguard_guard)])(provider)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    return app


# -- the outcomes -------------------------------------------------------------------------------
Setup = Callable[[SpendGuard], Awaitable[None]]


async def nothing(guard: SpendGuard) -> None:
    pass


async def zero_key_limit(guard: SpendGuard) -> None:
    await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=0)


async def tiny_balance(guard: SpendGuard) -> None:
    await guard.admin.topup("acme", "0.000001")  # one micro-USD: the first request uses it up


async def other_models_only(guard: SpendGuard) -> None:
    await guard.admin.allow_models("acme", "alpha", ["gpt-*"])


async def one_request_a_minute(guard: SpendGuard) -> None:
    await guard.admin.set_rates("acme", "alpha", rpm=1)


@dataclass(frozen=True)
class Outcome:
    status: int
    code: str | None  # the error body's code; None: the provider's answer
    setup: Setup = nothing  # after the common setup (a key limit, a rate, a budget)
    body: dict[str, Any] = field(default_factory=chat_body)
    headers: dict[str, str] = field(default_factory=lambda: dict(ALPHA))
    before: int = 0  # the same request sent this many times first
    settings: dict[str, Any] = field(default_factory=dict)
    store_down: bool = False
    present: tuple[str, ...] = ()  # headers the compared answer must carry
    absent: tuple[str, ...] = ()  # headers it must not carry
    records: int = 0  # inference records the ledger holds at the end


# What every admitted answer carries with this setup: the inference id, the key's remaining
# spend, its rate and its token budget.
ADMITTED = (
    INFERENCE_ID,
    "x-spendguard-limit-usd-day",
    "x-spendguard-remaining-usd-day",
    "x-spendguard-reset-day",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-budget-api-key-limit",
    "x-budget-api-key-remaining",
    "x-budget-api-key-reset",
)
REMAINING = ("x-spendguard-limit-usd-day", "x-spendguard-remaining-usd-day")
NOTHING_ADMITTED = (INFERENCE_ID, "x-spendguard-remaining-usd-day", "x-ratelimit-limit-requests")

OUTCOMES = {
    "allowed": Outcome(200, None, present=ADMITTED, records=1),
    "allowed, streamed": Outcome(
        200,
        None,
        body=chat_body(stream=True, stream_options={"include_usage": True}),
        present=ADMITTED,
        records=1,
    ),
    "upstream error": Outcome(500, None, body=chat_body(x_status=500), present=ADMITTED),
    "spend limit": Outcome(
        429,
        "spend_limit_exceeded",
        zero_key_limit,
        present=(*REMAINING, "retry-after", "x-should-retry"),
        absent=(INFERENCE_ID,),
    ),
    "balance exhausted": Outcome(
        429,
        "insufficient_quota",
        tiny_balance,
        before=1,
        present=(*REMAINING, "x-should-retry"),
        absent=(INFERENCE_ID, "retry-after"),
        records=1,
    ),
    "model not allowed": Outcome(403, "model_not_allowed", other_models_only),
    "budget": Outcome(  # 15 used, 2 + 990 held: over the 1,000
        429,
        "budget_exceeded",
        body=chat_body(max_tokens=990),
        settings={"budgets": section(scopes={"per_api_key": {"tokens": 1000}})},
        before=1,
        present=("retry-after",),
        absent=NOTHING_ADMITTED,
        records=1,
    ),
    "request exceeds the budget": Outcome(  # its hold alone is over the 1,000
        429,
        "request_exceeds_budget",
        body=chat_body(max_tokens=2000),
        settings={"budgets": section(scopes={"per_api_key": {"tokens": 1000}})},
        present=("x-should-retry",),
        absent=(*NOTHING_ADMITTED, "retry-after"),
    ),
    "spend limit of $0 and a budget": Outcome(  # the $0 outlasts "lower max_tokens"
        429,
        "spend_limit_exceeded",
        zero_key_limit,
        body=chat_body(max_tokens=2000),
        settings={"budgets": section(scopes={"per_api_key": {"tokens": 1000}})},
        present=(*REMAINING, "retry-after", "x-should-retry"),
        absent=(INFERENCE_ID,),
    ),
    "rate limit": Outcome(
        429,
        "rate_limit_exceeded",
        one_request_a_minute,
        before=1,
        present=("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"),
        absent=(INFERENCE_ID,),
        records=1,
    ),
    "bad body": Outcome(400, "invalid_request", body={"model": 5}, absent=NOTHING_ADMITTED),
    "body too large": Outcome(
        413,
        "request_too_large",
        body=chat_body(padding="x" * 5000),
        settings={"max_body_bytes": 4096},
        absent=NOTHING_ADMITTED,
    ),
    "store unavailable": Outcome(
        503,
        "spend_limit_unavailable",
        store_down=True,
        present=("retry-after",),
        absent=NOTHING_ADMITTED,
    ),
    "missing identity": Outcome(401, "missing_identity", headers={}, absent=NOTHING_ADMITTED),
}


# -- one gateway per path -----------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: list[tuple[str, str]]  # sorted; the inference id's value masked
    records: list[tuple[Any, ...]]


async def down(*args: Any, **kwargs: Any) -> Any:
    raise StoreUnavailable("the store is down")


async def serve(
    build: Callable[[SpendGuard], FastAPI], outcome: Outcome, directory: Path
) -> tuple[httpx.Response, Answer]:
    clock = Clock()  # the same instant on both paths
    settings = {
        "budgets": section(scopes={"per_api_key": {"tokens": 10**6}}),
        **outcome.settings,
    }
    url = f"sqlite:///{directory / 'ledger.db'}"
    store: Any = MemoryStore(clock=clock)
    if outcome.store_down:
        store = Override(store, preflight=down)
    guard = SpendGuard(
        Settings(
            database_url=url,
            prices=write_unit_prices(directory),
            run_worker=False,
            remaining_headers=True,
            **settings,
        ),
        store=store,
        clock=clock,
    )
    app = build(guard)
    async with lifespan(app), client(app) as c:
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1)
        await guard.admin.set_rates("acme", "alpha", rpm=100)
        await outcome.setup(guard)
        for _ in range(outcome.before):
            first = await c.post(PATH, json=outcome.body, headers=outcome.headers)
            assert first.status_code == 200, first.text
        r = await c.post(PATH, json=outcome.body, headers=outcome.headers)
        await guard.recorder.flush()
        query = sa.select(
            records.c.team_id,
            records.c.api_key_id,
            records.c.route,
            records.c.model,
            records.c.status_code,
            records.c.input_tokens,
            records.c.output_tokens,
        ).order_by(records.c.t0_us, records.c.status_code)
        stored = await sql_rows(url, query)
    headers = sorted(
        (name, "<per request>" if name == INFERENCE_ID else value)
        for name, value in r.headers.multi_items()
    )
    return r, Answer(r.status_code, r.content, headers, stored)


@pytest.fixture
def directories(tmp_path: Path) -> tuple[Path, Path]:
    """A directory for each path's ledger file and price table."""
    (tmp_path / "middleware").mkdir()
    (tmp_path / "depends").mkdir()
    return tmp_path / "middleware", tmp_path / "depends"


@pytest.mark.parametrize("name", list(OUTCOMES))
async def test_both_paths_give_the_same_answer(name: str, directories: tuple[Path, Path]) -> None:
    outcome = OUTCOMES[name]
    r, by_middleware = await serve(middleware_path, outcome, directories[0])
    _, by_depends = await serve(depends_path, outcome, directories[1])

    # The outcome is the one meant (checked on one path; the other must equal it).
    assert r.status_code == outcome.status, r.text
    if outcome.code is None:
        assert r.headers["content-type"].startswith(("application/json", "text/event-stream"))
    else:
        assert r.json()["error"]["code"] == outcome.code
    for header in outcome.present:
        assert header in r.headers, (header, r.headers)
    for header in outcome.absent:
        assert header not in r.headers, (header, r.headers)
    assert len(by_middleware.records) == outcome.records

    # ... and identical on the other path: status, body, every header, what was recorded.
    assert by_depends.status == by_middleware.status
    assert by_depends.body == by_middleware.body
    assert by_depends.headers == by_middleware.headers
    assert by_depends.records == by_middleware.records
