"""The fake provider as its own process, counting every request it receives.

``uvicorn tests.compat.provider:app`` serves :func:`spendguard.testing.fake_upstream` behind a
counter of every HTTP request, whatever its path or method (a request for a path the fake does
not answer still reached the provider), and tells another process what it received:

* ``GET /_compat/received``: ``{"count": N, "posts": M, "requests": [{"method", "path",
  "model", "body"}...]}``: every request, those that were not GETs (LiteLLM lists the models
  with GETs when it starts), and the last 1000 (``body``: the JSON the gateway sent, or null);
* ``GET /health``: 200, not counted.

Compat tests read it before and after a refused request: spendguard refused it only if the count
did not move.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from spendguard.testing import fake_upstream

_KEPT = 1000


class CountingProvider:
    def __init__(self) -> None:
        self.fake = fake_upstream()
        self.count = 0
        self.posts = 0
        self.requests: deque[dict[str, Any]] = deque(maxlen=_KEPT)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fake(scope, receive, send)
            return
        path: str = scope["path"]
        if scope["method"] == "GET" and path in ("/health", "/_compat/received"):
            payload = {"count": self.count, "posts": self.posts, "requests": list(self.requests)}
            await _json(send, payload if path != "/health" else {})
            return
        self.count += 1
        if scope["method"] != "GET":
            self.posts += 1
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        self.requests.append(
            {"method": scope["method"], "path": path, "model": model, "body": body}
        )
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.fake(scope, replay, send)


async def _json(send: Send, payload: object) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


app = CountingProvider()
