"""1b. spendguard alone: the middleware over an app that answers at once.

Section 1 times spendguard among the gateway's own work, where its figures move with
everything else the process does (caches, the collector, the fake provider). Here nothing else
runs: an ASGI app replays a provider's recorded response (``tests/fixtures/wire``: a chat
completion as JSON, and the same as an SSE stream in its recorded chunks) the moment it is
called, so the process's CPU per inference is spendguard's own: the request parse, preflight,
reading the response's usage, postflight and the record written. It is the steadiest figure
of the suite (about ±1 µs between runs) and the one to watch for a regression of the request
path. Both stores, one request at a time and 64 in flight, taking turns.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Final

from starlette.types import Message, Receive, Scope, Send

from spendguard import SpendGuardMiddleware

from .apps import INFERENCE_PATH, KEY_ID, TEAM_ID, chat_body
from .asgi import Call, drive, http_scope, lifespan
from .common import Services, Sizes, bench_identity, set_policies
from .inprocess import variant_settings
from .stats import summary

WIRE: Final = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "wire"
VARIANTS: Final = ("embedded", "redis")
CASES: Final = (("inference", 1), ("inference", 64), ("stream", 64))


def _sse_chunks(text: bytes) -> list[bytes]:
    # One body message per SSE event, as a provider's chunks arrive.
    return [event + b"\n\n" for event in text.split(b"\n\n") if event.strip()]


class _Replay:
    """The provider's recorded answer, at once: no upstream, no framework."""

    def __init__(self) -> None:
        self.json = (WIRE / "openai-chat.json").read_bytes()
        self.stream = _sse_chunks((WIRE / "openai-chat-stream-usage.sse").read_bytes())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        message: Message = await receive()
        streamed = b'"stream":true' in message.get("body", b"")
        kind = b"text/event-stream" if streamed else b"application/json"
        start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        await send(start)
        for chunk in self.stream if streamed else [self.json]:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _call(app: Any, route: str) -> Call:
    body = chat_body(stream=route == "stream")
    headers = [(b"content-type", b"application/json"), (b"host", b"gateway")]
    return Call(app, http_scope("POST", INFERENCE_PATH, headers, body), body)


async def _cpu_per_request(
    call: Call, concurrency: int, n: int, flush: Callable[[], Awaitable[None]]
) -> float:
    gc.collect()
    start = time.process_time()
    await drive(call, concurrency, n)
    await flush()  # the records' writes are spendguard's CPU too
    return (time.process_time() - start) / n * 1e6


async def measure(services: Services, sizes: Sizes, repeats: int) -> dict[str, Any]:
    await set_policies(services.sqlite_url, bench_identity())
    await set_policies(services.postgres_url, bench_identity())
    n = sizes.inproc_inference * 4
    cpu: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    async with AsyncExitStack() as stack:
        apps = {
            v: SpendGuardMiddleware(
                _Replay(),
                variant_settings(v, services),
                resolve_identity=lambda _conn: (TEAM_ID, KEY_ID),
            )
            for v in VARIANTS
        }
        for app in apps.values():
            await stack.enter_async_context(lifespan(app))
        calls = {v: {route: _call(app, route) for route, _ in CASES} for v, app in apps.items()}

        async def flush(v: str) -> None:
            guard = apps[v].guard
            assert guard is not None
            await guard.recorder.flush()

        for v in VARIANTS:  # warm: connections, scripts, caches, code paths
            for route, conc in CASES:
                await _cpu_per_request(calls[v][route], conc, n // 4, lambda v=v: flush(v))
        for rep in range(repeats):
            for i, v in enumerate(VARIANTS[rep % 2 :] + VARIANTS[: rep % 2]):
                for route, conc in CASES[i % 2 :] + CASES[: i % 2]:
                    us = await _cpu_per_request(calls[v][route], conc, n, lambda v=v: flush(v))
                    cpu[v].setdefault(f"{route}/{conc}", []).append(us)
    figures = {v: {case: summary(xs) for case, xs in cases.items()} for v, cases in cpu.items()}
    return {"requests": n, "cpu_us": figures}
