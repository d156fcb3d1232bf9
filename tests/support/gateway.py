"""A gateway in a test: spendguard's middleware in front of a fake upstream, on a settable
clock, the embedded store (or any injected one) and a real SQLite (or PostgreSQL) ledger.

``upstream()`` answers like a provider and obeys ``x_*`` fields of the request body: ``x_in``
and ``x_out`` (usage), ``x_status`` (an upstream error), ``x_encoding`` (gzip, or undecodable
"br" bytes), ``x_chunks``, ``x_fail_at`` and ``x_stall_at`` (a stream that breaks or hangs).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.ledger import Ledger
from spendguard.limits import Limit, Period
from spendguard.money import micros_to_usd
from spendguard.store import Store
from spendguard.store.memory import MemoryStore

from .asgi import StateAuth
from .clock import Clock
from .doubles import Counting
from .prices import UNIT_MODEL, write_unit_prices

MODEL = UNIT_MODEL  # 1 micro-USD per token: a default chat_body() request costs 10 + 5 = 15


async def _chat(request: Request) -> Response:
    if request.method == "GET":
        return JSONResponse({"object": "list"})
    body = await request.json()
    status = int(body.get("x_status", 200))
    if status != 200:
        return JSONResponse({"error": {"message": "upstream broke"}}, status_code=status)
    usage = {"prompt_tokens": body.get("x_in", 10), "completion_tokens": body.get("x_out", 5)}
    if not body.get("stream"):
        payload = {
            "object": "chat.completion",
            "model": body["model"],
            "choices": [],
            "usage": usage,
        }
        if body.get("x_encoding") == "gzip":
            raw = gzip.compress(json.dumps(payload).encode())
            headers = {"content-encoding": "gzip"}
            return Response(raw, media_type="application/json", headers=headers)
        if body.get("x_encoding") == "br":  # undecodable here: pretend-compressed bytes
            headers = {"content-encoding": "br"}
            return Response(b"\x00" * 100, media_type="application/json", headers=headers)
        return JSONResponse(payload)

    async def events() -> AsyncIterator[bytes]:
        for i in range(int(body.get("x_chunks", 3))):
            if body.get("x_fail_at") == i:
                raise RuntimeError("upstream died mid-stream")
            if body.get("x_stall_at") == i:
                await anyio.sleep_forever()
            delta = {"choices": [{"index": 0, "delta": {"content": "word "}}]}
            yield f"data: {json.dumps(delta)}\n\n".encode()
        if body.get("stream_options", {}).get("include_usage"):
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _other(request: Request) -> Response:
    return JSONResponse({"ok": True})


def upstream() -> Starlette:
    """The fake provider: the chat and messages routes, and a non-inference /health."""
    return Starlette(
        routes=[
            Route("/v1/chat/completions", _chat, methods=["POST", "GET"]),
            Route("/v1/messages", _chat, methods=["POST"]),
            Route("/health", _other, methods=["GET", "POST"]),
        ]
    )


def chat_body(**extra: Any) -> dict[str, Any]:
    """A chat request for the unit-priced model, with ``extra`` fields (the ``x_*`` knobs)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def client(app: ASGIApp, base_url: str = "http://gw") -> httpx.AsyncClient:
    """An HTTP client that calls ``app`` in process."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)


class Gateway:
    """The middleware behind :class:`StateAuth` (team ``acme``, key ``alpha``) in front of
    :func:`upstream`. Every store and ledger call is counted (``gw.store.calls``,
    ``gw.ledger.calls``): tests show what a request never reaches. ``settings`` are
    :class:`Settings` fields."""

    def __init__(
        self,
        tmp_path: Path,
        clock: Any = None,
        *,
        store: Store | None = None,
        database_url: str | None = None,
        **settings: Any,
    ) -> None:
        self.clock = clock or Clock()
        self.settings = Settings(
            database_url=database_url or f"sqlite:///{tmp_path / 'ledger.db'}",
            prices=write_unit_prices(tmp_path),
            **settings,
        )
        self.store: Any = Counting(store if store is not None else MemoryStore(clock=self.clock))
        url = self.settings.database_url.get_secret_value()
        self.ledger: Any = Counting(Ledger(url))
        self.guard = SpendGuard(
            self.settings, store=self.store, ledger=self.ledger, clock=self.clock
        )
        self.inner = upstream()
        self.app: ASGIApp = StateAuth(SpendGuardMiddleware(self.inner, guard=self.guard))
        self.postflights = 0
        real = self.guard.postflight

        async def counting(*args: Any, **kwargs: Any) -> Any:
            self.postflights += 1
            return await real(*args, **kwargs)

        self.guard.postflight = counting  # type: ignore[method-assign]

    async def __aenter__(self) -> Gateway:
        # The record writer runs; settlement only when a test calls settle() (deterministic).
        await self.guard.start(worker=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.guard.stop()

    def client(self) -> httpx.AsyncClient:
        return client(self.app)

    async def post(self, **extra: Any) -> httpx.Response:
        """One chat request (``chat_body(**extra)``) on a client of its own."""
        async with self.client() as c:
            return await c.post("/v1/chat/completions", json=chat_body(**extra))

    async def policy(self, period: Period, usd_micros: int, key: str | None = "alpha") -> None:
        """Set a limit through the admin API, which also drops the cached policy."""
        await self.guard.admin.set_policy(
            "acme", key, window=period, limit_usd=micros_to_usd(usd_micros)
        )

    async def settle(self) -> None:
        await self.guard.recorder.flush()
        await self.guard.worker.run_once()

    async def aggregates(self) -> dict[tuple[Limit, str], int]:
        return {(a.limit, a.bucket): a.settled for a in await self.guard.ledger.aggregates()}
