"""Driving an ASGI app directly, as a server would but without sockets: its lifespan, and one
request with a prebuilt scope so that the measured time is the app's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.types import ASGIApp, Message


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run ``app``'s lifespan around a block (startup before, shutdown after)."""
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}

    async def run() -> None:
        await app(scope, to_app.get, from_app.put)

    task = asyncio.create_task(run())
    await to_app.put({"type": "lifespan.startup"})
    started = await from_app.get()
    if started["type"] != "lifespan.startup.complete":
        task.cancel()
        raise RuntimeError(f"app startup failed: {started}")
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        done = await from_app.get()
        if done["type"] != "lifespan.shutdown.complete":
            raise RuntimeError(f"app shutdown failed: {done}")
        await task


def http_scope(
    method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes = b""
) -> dict[str, Any]:
    """What uvicorn hands an app for one request (ASGI spec 2.3, like uvicorn's h11 server)."""
    raw = [(k.lower(), v) for k, v in headers]
    if body:
        raw.append((b"content-length", str(len(body)).encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": method,
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": raw,
    }


class Call:
    """One request against an app: ``await call()`` returns the response status and the
    ``perf_counter_ns`` time its last body byte was sent (what a client waits for; the app may
    still work after it, as spendguard's postflight does).

    The scope is copied per call (apps write into ``scope["state"]``). After the body, ``receive``
    blocks like a connection that stays open; Starlette's streaming response listens for a
    disconnect that way and cancels the wait when the body is done.
    """

    __slots__ = ("_app", "_body", "_scope")

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes = b"") -> None:
        self._app, self._scope, self._body = app, scope, body

    async def __call__(self) -> tuple[int, int]:
        scope = dict(self._scope)
        scope["state"] = {}
        body = self._body
        sent = False
        status = 0
        done = 0

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.get_running_loop().create_future()  # until cancelled
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            # As strict as a server: one start, then body messages (a middleware that breaks
            # the protocol must fail here, not look fast).
            nonlocal status, done
            if message["type"] == "http.response.start":
                if status:
                    raise RuntimeError("http.response.start sent twice")
                status = message["status"]
            elif message["type"] == "http.response.body":
                if not status or done:
                    raise RuntimeError("http.response.body out of order")
                if not message.get("more_body", False):
                    done = time.perf_counter_ns()

        await self._app(scope, receive, send)
        return status, done
