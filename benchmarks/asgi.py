"""Driving an ASGI app directly, as a server would but without sockets: its lifespan, and one
request with a prebuilt scope so that the measured time is the app's own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Message

# The lifespan driver and the request scope are the tests' own (tests/support/asgi.py).
from tests.support.asgi import http_scope, lifespan

__all__ = ["Call", "drive", "http_scope", "lifespan"]


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


async def drive(call: Call, concurrency: int, n: int) -> None:
    """``n`` requests through ``call``, ``concurrency`` at a time; an answer other than 200
    raises (a benchmark must not time refusals)."""
    left = n

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            status, _ = await call()
            if status != 200:
                raise RuntimeError(f"benchmark request answered {status}")

    await asyncio.gather(*(client() for _ in range(concurrency)))
