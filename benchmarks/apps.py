"""The gateways under test: the example gateway (examples/gateway.py), rebuilt per variant.

Every variant has the example's routes, lifespan (the fake upstream provider, called in process
and streamed) and bearer auth, and the same plain proxy handler (the example's handler without
its provider-key router); they differ only in the one middleware between auth and the app:

* ``bare``: none, the baseline every ratio is taken against;
* ``embedded``: ``SpendGuardMiddleware`` on the embedded store (SQLite ledger);
* ``redis``: ``SpendGuardMiddleware`` on the Redis store (PostgreSQL ledger);
* ``slowapi``: the peer, slowapi's ``SlowAPIMiddleware`` with its Redis storage and a per-key
  limit on the inference routes (what users add instead of a spend limiter). Its pure-ASGI
  ``SlowAPIASGIMiddleware`` is not used: it re-sends ``http.response.start`` before every body
  chunk, which breaks streamed responses (slowapi issues #249 and #260), and every response of
  this gateway is streamed from the provider.

Served by uvicorn through ``create_app`` (``--factory``); spendguard variants read their
settings from ``SPENDGUARD_*`` like the example does.
"""

from __future__ import annotations

import json
import os
from typing import Final

import httpx
from fastapi import FastAPI
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp

from examples import gateway
from spendguard import Settings, SpendGuardMiddleware

VARIANTS: Final = ("bare", "embedded", "redis", "slowapi")
LABELS: Final = {
    "bare": "bare app",
    "embedded": "spendguard, embedded store",
    "redis": "spendguard, Redis store",
    "slowapi": "slowapi (Redis storage)",
}

MODEL: Final = "gpt-4o-mini"
TEAM_ID: Final = "acme"
KEY_ID: Final = "alpha"
TOKEN: Final = "sk-demo-alpha"  # the example's own demo key: team acme, key alpha
INFERENCE_PATH: Final = "/v1/chat/completions"
HEALTH_PATH: Final = "/health"
# The peer's per-key limit: high enough never to refuse during the throughput runs.
PEER_LIMIT: Final = "1000000000/day"


def overshoot_token(trial: int) -> str:
    return f"sk-bench-over-{trial}"


def overshoot_team(trial: int) -> str:
    return f"overshoot-{trial}"


# The overshoot runs need a fresh team per trial; the example's auth looks bearer tokens up in
# its DEMO_KEYS table, so the benchmark registers its own tokens there (same lookup, same cost).
MAX_OVERSHOOT_TRIALS: Final = 200
gateway.DEMO_KEYS.update(
    {overshoot_token(i): (overshoot_team(i), "k") for i in range(MAX_OVERSHOOT_TRIALS)}
)


def chat_body(*, stream: bool = False) -> bytes:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


async def _plain_proxy(request: Request, path: str) -> Response:
    """The example's proxy without its provider-key router: one upstream, bytes relayed as
    they come. The router (a pool lease, a JSON parse of the body, usage read from every
    chunk) is the gateway's own work, not spendguard's: in the baseline it would inflate every
    ratio taken against it."""
    client: httpx.AsyncClient = request.app.state.upstream
    headers = {k: v for k, v in request.headers.items() if k == "content-type"}
    upstream = await client.send(
        client.build_request("POST", path, content=await request.body(), headers=headers),
        stream=True,
    )
    passed = {
        k: v for k, v in upstream.headers.items() if k in ("content-type", "content-encoding")
    }
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=passed,
        background=BackgroundTask(upstream.aclose),
    )


async def _inference(request: Request) -> Response:
    return await _plain_proxy(request, request.url.path)


async def _anthropic(request: Request) -> Response:
    return await _plain_proxy(request, "/v1/messages")


def _base_app() -> FastAPI:
    app = FastAPI(title="demo gateway", lifespan=gateway.lifespan)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"):
        app.add_api_route(path, _inference, methods=["POST"])
    app.add_api_route("/v1/messages", _inference, methods=["POST"])
    app.add_api_route("/anthropic/v1/messages", _anthropic, methods=["POST"])
    app.add_api_route(HEALTH_PATH, gateway.health, methods=["GET"])
    return app


def _peer_key(request: Request) -> str:
    # Per key, like spendguard's API-key limits: the identity the gateway's auth resolved.
    state = request.scope.get("state", {})
    return f"{state.get('team_id', '-')}:{state.get('api_key_id', '-')}"


def _add_peer(app: FastAPI, redis_url: str) -> None:
    from slowapi import Limiter
    from slowapi.middleware import SlowAPIMiddleware

    limiter = Limiter(
        key_func=_peer_key,
        default_limits=[PEER_LIMIT],
        storage_uri=redis_url,
        strategy="fixed-window",
        key_prefix="bench",
    )
    limiter.exempt(gateway.health)  # type: ignore[no-untyped-call]  # inference routes only
    app.state.limiter = limiter
    app.add_middleware(SlowAPIMiddleware)


def build_gateway(
    variant: str, *, settings: Settings | None = None, redis_url: str | None = None
) -> ASGIApp:
    """The example gateway with ``variant``'s middleware (see the module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    app = _base_app()
    if variant in ("embedded", "redis"):
        # Added inside the auth, exactly like examples/gateway.py.
        app.add_middleware(SpendGuardMiddleware, settings=settings)
    elif variant == "slowapi":
        if redis_url is None:
            raise ValueError("the slowapi peer needs a Redis URL")
        _add_peer(app, redis_url)
    app.add_middleware(gateway.BearerAuth)
    return app


def create_app() -> ASGIApp:
    """uvicorn factory: the variant comes from ``BENCH_GATEWAY_VARIANT``."""
    variant = os.environ.get("BENCH_GATEWAY_VARIANT", "bare")
    return build_gateway(variant, redis_url=os.environ.get("BENCH_REDIS_URL"))
