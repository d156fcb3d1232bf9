"""A small LLM gateway as you may already run one, with spendguard added in three lines.

Its own auth maps bearer tokens to a team and an API key in the request state; it proxies the
inference routes to ``GATEWAY_UPSTREAM_URL`` (an OpenAI/Anthropic-compatible base URL, e.g.
``https://api.openai.com``) or, by default, to spendguard's fake upstream provider.

Its router declares its upstream keys to spendguard (``candidates=``), which leases one from
the provider-key pool in the same round trip as the spend checks and settles it when the
response ends; the handler finds the lease in ``request.state.spendguard_provider_key``. The
fake upstream is reached through two keys, ``fake-key-1`` (which answers every call with a
429) and ``fake-key-2``; on a 429 the router puts the key in a cooldown, gives the lease back
and leases the next key itself, so every later request goes straight to the second. Each key
allows ``GATEWAY_PROVIDER_RPM`` requests and
``GATEWAY_PROVIDER_TPM`` tokens per minute (unset: unlimited); a 429 without ``Retry-After``
cools a key for ``GATEWAY_COOLDOWN`` seconds (default 30). Replicas share the pool through
``GATEWAY_POOL_URL`` (a Redis URL; unset: in this process).

    uvicorn examples.gateway:app --port 8000

With ``SPENDGUARD_ADMIN_TOKEN`` set, spendguard's admin routes answer under
``/admin/spendguard`` (docs/admin-http.md); Prometheus metrics are at ``/metrics``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard import (
    STATE_PROVIDER_KEY,
    Lease,
    NoCapacity,
    ProviderKey,
    ProviderPool,
    SpendGuardMiddleware,
    StoreUnavailable,
    retry_after_seconds,
)
from spendguard.asgi import admin_app
from spendguard.testing import StreamingASGITransport, fake_upstream
from spendguard.usage import Dialect, Usage, UsageObserver

log = logging.getLogger("gateway")

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


def _provider_keys() -> dict[str, dict[str, str]]:
    """The router's provider keys: id -> the headers that call the upstream with that key.
    Only the ids reach the pool; the secrets stay here."""
    if os.environ.get("GATEWAY_UPSTREAM_URL"):
        secret = os.environ.get("GATEWAY_UPSTREAM_API_KEY")
        auth = {"authorization": f"Bearer {secret}", "x-api-key": secret} if secret else {}
        return {"upstream": auth}
    # Two keys on the fake provider; the first one is always rate limited there.
    return {"fake-key-1": {"x-fake-fail": "429"}, "fake-key-2": {}}


PROVIDER_KEYS = _provider_keys()


def _upstream_client() -> httpx.AsyncClient:
    url = os.environ.get("GATEWAY_UPSTREAM_URL")
    if url:
        return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10))
    # No upstream configured: spendguard's fake provider, called in process but streamed.
    return httpx.AsyncClient(
        base_url="http://fake-upstream", transport=StreamingASGITransport(fake_upstream())
    )


def _capacity(name: str) -> int | None:
    raw = os.environ.get(name)
    return None if raw is None else int(raw)  # unset: unlimited


# Replicas share capacity and cooldowns through Redis (GATEWAY_POOL_URL=redis://...); the
# default keeps the pool in this process.
POOL = ProviderPool.from_url(os.environ.get("GATEWAY_POOL_URL", "memory://"), timeout=2)


def candidates(model: str, identity: object) -> list[str]:
    """The router's keys for an inference, in order of preference (every model: every key)."""
    return list(PROVIDER_KEYS)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    rpm, tpm = _capacity("GATEWAY_PROVIDER_RPM"), _capacity("GATEWAY_PROVIDER_TPM")
    try:
        # Every replica registers the same keys at start; counters and cooldowns are kept.
        await POOL.register(*(ProviderKey(k, "fake", tpm=tpm, rpm=rpm) for k in PROVIDER_KEYS))
        async with _upstream_client() as client:
            app.state.upstream = client
            yield
    finally:
        await POOL.aclose()


app = FastAPI(title="demo gateway", lifespan=lifespan)

_FORWARD = ("content-type", "anthropic-version", "anthropic-beta", "openai-beta")


COOLDOWN = float(os.environ.get("GATEWAY_COOLDOWN", "30"))


def _used(usage: Usage | None, reserved: int) -> int:
    if usage is None:
        return reserved  # the provider reported nothing: keep the reservation
    return (
        usage.input_tokens
        + usage.output_tokens
        + usage.cached_input_tokens
        + usage.cache_write_tokens
    )


def _no_capacity(exc: NoCapacity) -> Response:
    headers = {} if exc.retry_after is None else {"retry-after": str(exc.retry_after)}
    error = {"type": "rate_limit_error", "code": "no_provider_capacity", "message": str(exc)}
    return JSONResponse({"error": error}, status_code=429, headers=headers)


async def _proxy(request: Request, path: str) -> Response:
    client: httpx.AsyncClient = request.app.state.upstream
    headers = {
        k: v
        for k, v in request.headers.items()
        # x-fake-* lets tests and the curious steer the fake provider (errors, stalls...).
        if k in _FORWARD or k.startswith("x-fake-")
    }
    body = await request.body()
    # 1. spendguard leased the first key with room that is not cooling down, at admission
    # (and settles it when the response ends); a refusal never reaches this handler.
    lease: Lease = getattr(request.state, STATE_PROVIDER_KEY)
    mine: Lease | None = None  # a key this router leased itself, after a 429: it settles it
    candidates = list(PROVIDER_KEYS)
    attempts = 1
    while True:
        try:
            upstream = await client.send(
                client.build_request(
                    "POST", path, content=body, headers=headers | PROVIDER_KEYS[lease.key_id]
                ),
                stream=True,
            )
        except BaseException:
            # The call never reached the provider; give a lease of ours back even when
            # cancelled (spendguard releases its own: the response was not charged).
            if mine is not None:
                with anyio.CancelScope(shield=True):
                    await POOL.release(mine)
            raise
        if upstream.status_code != 429:
            break
        # 2. a 429: cool the key on every replica for as long as the provider asks, give the
        # lease back, and lease one of the keys not tried yet (the pool's late choice).
        await upstream.aclose()
        await POOL.cooldown(lease.key_id, retry_after_seconds(upstream.headers, default=COOLDOWN))
        await POOL.release(lease)
        candidates.remove(lease.key_id)
        try:
            lease = mine = await POOL.acquire(candidates, tokens=lease.tokens)
        except NoCapacity as exc:
            return _no_capacity(exc)
        except StoreUnavailable:
            return JSONResponse({"error": {"type": "unavailable"}}, status_code=503)
        attempts += 1

    dialect = Dialect.ANTHROPIC if path.endswith("/messages") else Dialect.OPENAI
    content_type = upstream.headers.get("content-type")
    # Compressed bodies are not read here: such a lease keeps its estimate.
    observer = (
        None if upstream.headers.get("content-encoding") else UsageObserver(dialect, content_type)
    )

    async def relay() -> AsyncIterator[bytes]:
        async for chunk in upstream.aiter_raw():
            if observer is not None:
                observer.feed(chunk)
            yield chunk

    async def finish() -> None:
        await upstream.aclose()
        if mine is None:
            return  # spendguard's lease: spendguard settles it with the usage it observed
        # 3. settle the router's own lease: true it up to what the call used.
        used = _used(None if observer is None else observer.result(), mine.tokens)
        try:
            await POOL.settle(mine, tokens=used)
        except (StoreUnavailable, ValueError) as exc:
            log.warning("could not settle provider lease on %s: %s", mine.key_id, exc)

    passed = {
        k: v
        for k, v in upstream.headers.items()
        if k in ("content-type", "content-encoding", "retry-after")
    }
    # Which key served it and after how many tries: for the demo's readers and its tests.
    passed["x-gateway-provider-key"] = lease.key_id
    passed["x-gateway-attempts"] = str(attempts)
    return StreamingResponse(
        relay(),
        status_code=upstream.status_code,
        headers=passed,
        background=BackgroundTask(finish),
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
# The router's candidate keys are declared to it, so the lease rides the admission round.
app.add_middleware(SpendGuardMiddleware, candidates=candidates, pool=POOL)
app.add_middleware(BearerAuth)

# spendguard's admin routes (policies, usage, balances, status...): off (404) unless
# SPENDGUARD_ADMIN_TOKEN is set, then behind "Authorization: Bearer <that token>".
app.mount("/admin/spendguard", admin_app(app))


# Prometheus metrics (spendguard's, in the default registry), for a scraper on the inside.
@app.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
