"""A small LLM gateway as you may already run one, with spendguard added in three lines.

Its own auth maps bearer tokens to a team and an API key in the request state; it proxies the
inference routes to ``GATEWAY_UPSTREAM_URL`` (an OpenAI/Anthropic-compatible base URL, e.g.
``https://api.openai.com``) or, by default, to spendguard's fake upstream provider.

    uvicorn examples.gateway:app --port 8000
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard import SpendGuardMiddleware
from spendguard.testing import StreamingASGITransport, fake_upstream

# The gateway's own key store: bearer token -> (team, api key).
DEMO_KEYS = {
    "sk-demo-alpha": ("acme", "alpha"),
    "sk-demo-beta": ("acme", "beta"),
}


class BearerAuth:
    """The gateway's auth middleware: it, not the client, decides the team and key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            token = headers.get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ")
            token = token or headers.get(b"x-api-key", b"").decode("latin-1")  # Anthropic SDK
            found = DEMO_KEYS.get(token)
            if found is not None:
                state = scope.setdefault("state", {})
                state["team_id"], state["api_key_id"] = found
        await self.app(scope, receive, send)


def _upstream_client() -> httpx.AsyncClient:
    url = os.environ.get("GATEWAY_UPSTREAM_URL")
    if url:
        return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10))
    # No upstream configured: spendguard's fake provider, called in process but streamed.
    return httpx.AsyncClient(
        base_url="http://fake-upstream", transport=StreamingASGITransport(fake_upstream())
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with _upstream_client() as client:
        app.state.upstream = client
        yield


app = FastAPI(title="demo gateway", lifespan=lifespan)

_FORWARD = ("content-type", "anthropic-version", "anthropic-beta", "openai-beta")


async def _proxy(request: Request, path: str) -> Response:
    client: httpx.AsyncClient = request.app.state.upstream
    headers = {
        k: v
        for k, v in request.headers.items()
        # x-fake-* lets tests and the curious steer the fake provider (errors, stalls...).
        if k in _FORWARD or k.startswith("x-fake-")
    }
    key = os.environ.get("GATEWAY_UPSTREAM_API_KEY")
    if key:
        headers["authorization"] = f"Bearer {key}"
        headers["x-api-key"] = key
    upstream = await client.send(
        client.build_request("POST", path, content=await request.body(), headers=headers),
        stream=True,
    )
    passed = {
        k: v
        for k, v in upstream.headers.items()
        if k in ("content-type", "content-encoding", "retry-after")
    }
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=passed,
        background=BackgroundTask(upstream.aclose),
    )


@app.post("/v1/chat/completions")
@app.post("/v1/completions")
@app.post("/v1/responses")
@app.post("/v1/embeddings")
@app.post("/v1/messages")
async def inference(request: Request) -> Response:
    return await _proxy(request, request.url.path)


@app.post("/anthropic/v1/messages")
async def anthropic_messages(request: Request) -> Response:
    return await _proxy(request, "/v1/messages")


@app.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"ok": True})


# spendguard: added inside the gateway's auth, so it sees the identity auth resolved.
# Settings come from SPENDGUARD_* environment variables (defaults: embedded store + SQLite).
app.add_middleware(SpendGuardMiddleware)
app.add_middleware(BearerAuth)
