"""Driving ASGI apps without a server: the lifespan, a request scope, and the auth middleware
a host app would put in front of spendguard."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run an ASGI app's lifespan around a block (startup before, shutdown after), as a
    server would."""
    to_app_send, to_app_recv = anyio.create_memory_object_stream[Message](10)
    from_app_send, from_app_recv = anyio.create_memory_object_stream[Message](10)
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}

    async def receive() -> Message:
        return await to_app_recv.receive()

    async def send(message: Message) -> None:
        await from_app_send.send(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(app, scope, receive, send)
        await to_app_send.send({"type": "lifespan.startup"})
        started = await from_app_recv.receive()
        if started["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"app startup failed: {started}")
        try:
            yield
        finally:
            await to_app_send.send({"type": "lifespan.shutdown"})
            done = await from_app_recv.receive()
            if done["type"] != "lifespan.shutdown.complete":
                raise RuntimeError(f"app shutdown failed: {done}")


def http_scope(
    method: str, path: str, headers: Sequence[tuple[bytes, bytes]] = (), body: bytes = b""
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


async def raw_call(
    app: ASGIApp,
    body: bytes,
    *,
    fail_send_after: int | None = None,
    disconnect_after: float | None = None,
    sent: list[Message] | None = None,
) -> list[Message]:
    """Drive one chat request by hand: ``send`` can fail like a vanished client, and
    ``receive`` disconnects after ``disconnect_after`` seconds or never. What the app sent is
    returned, and also appended to ``sent`` if given (kept when the call is cancelled)."""
    sent = sent if sent is not None else []
    got_body = False

    async def receive() -> Message:
        nonlocal got_body
        if not got_body:
            got_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_after is not None:
            await anyio.sleep(disconnect_after)
            return {"type": "http.disconnect"}
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: Message) -> None:
        if fail_send_after is not None and len(sent) >= fail_send_after:
            raise OSError("client went away")
        sent.append(message)

    scope = http_scope(
        "POST", "/v1/chat/completions", [(b"content-type", b"application/json")], body
    )
    with contextlib.suppress(OSError):
        await app(scope, receive, send)
    return sent


class StateAuth:
    """What a host app's auth middleware does: put the identity into the request state.

    The team and key default to ``acme``/``alpha``; a request may name others with the
    ``x-test-team`` and ``x-test-key`` headers (the middleware itself never reads headers).
    """

    def __init__(self, app: ASGIApp, team: str | None = "acme", key: str | None = "alpha") -> None:
        self.app, self.team, self.key = app, team, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.team is not None:
            state = scope.setdefault("state", {})
            headers = dict(scope["headers"])
            state["team_id"] = headers.get(b"x-test-team", self.team.encode()).decode()
            state["api_key_id"] = (
                headers.get(b"x-test-key", (self.key or "").encode()).decode() or None
            )
        await self.app(scope, receive, send)
