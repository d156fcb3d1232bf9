"""An httpx transport that runs an ASGI app in process and streams its response as it comes.

It serves both HTTP client libraries the official SDKs are built on: ``httpx`` (openai 1.x,
anthropic 0.x, and openai 3.x, which still accepts an ``httpx`` client) and its successor
``httpx2`` (which anthropic 2.x insists on): the response is built with the classes of the
library the request came from. Sync clients (``openai.OpenAI``, ``anthropic.Anthropic``) are
served too: the app then runs on an event loop in a thread of the transport's own (a blocking
portal), or on the loop of a portal the caller passes in.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager
from functools import cache
from typing import Any

import httpx
from anyio.from_thread import BlockingPortal, start_blocking_portal
from starlette.types import ASGIApp, Message


class StreamingASGITransport(httpx.AsyncBaseTransport, httpx.BaseTransport):
    """An httpx (or httpx2) transport that calls an ASGI app in process and streams its
    response.

    ``httpx.ASGITransport`` collects the whole body before returning; this one hands chunks
    over as the app sends them, and closing the response tells the app the client left
    (``http.disconnect``), as a real server would. Used by the demo gateway to reach the fake
    upstream, and by tests that need streaming and disconnects without sockets. The app runs
    on asyncio.

    For a sync client, pass ``portal=`` to run the app on that portal's event loop (a test's
    own loop, where the gateway under test lives); without one, the transport starts its own
    loop in a thread on first use and stops it in :meth:`close`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        client: tuple[str, int] = ("127.0.0.1", 123),
        portal: BlockingPortal | None = None,
    ) -> None:
        self.app = app
        self.client = client
        self._portal = portal
        self._own_portal: AbstractContextManager[BlockingPortal] | None = None

    def handle_request(self, request: Any) -> Any:
        """A sync client's request: the app runs on the portal's loop, chunks come over."""
        portal = self._sync_portal()
        request.read()
        response = portal.call(self.handle_async_request, request)
        stream = _flavour_of(response).sync_stream(response.stream, portal)
        return type(response)(response.status_code, headers=response.headers.raw, stream=stream)

    def close(self) -> None:
        own, self._own_portal = self._own_portal, None
        if own is not None:
            self._portal = None
            own.__exit__(None, None, None)

    def _sync_portal(self) -> BlockingPortal:
        if self._portal is None:
            self._own_portal = start_blocking_portal("asyncio")
            self._portal = self._own_portal.__enter__()
        return self._portal

    async def handle_async_request(self, request: Any) -> Any:
        # A sync client's request was read in its own thread; an async one is read here.
        body = request.content if _is_read(request) else await request.aread()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "root_path": "",
            "query_string": request.url.query,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": self.client,
            "server": (request.url.host, request.url.port or 80),
            "state": {},
        }
        loop = asyncio.get_running_loop()
        started: asyncio.Future[Message] = loop.create_future()
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                if gone.is_set():
                    # What an ASGI 2.4 server does once the client has gone.
                    raise OSError("client disconnected")
                if message.get("body"):
                    chunks.put_nowait(message["body"])
                if not message.get("more_body", False):
                    chunks.put_nowait(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                if not started.done():
                    started.set_exception(httpx.RemoteProtocolError(f"app failed: {exc!r}"))
                chunks.put_nowait(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                chunks.put_nowait(None)

        task = loop.create_task(run())
        try:
            start = await started
        except BaseException:
            gone.set()
            task.cancel()
            raise
        headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        flavour = _flavour_of(request)
        return flavour.response(
            start["status"], headers=headers, stream=flavour.async_stream(chunks, task, gone)
        )


def _is_read(request: Any) -> bool:
    try:
        request.content  # noqa: B018 - raises until the body was read
    except Exception:
        return False
    return True


class _AppStream:
    """The response body: the app's chunks in order; closing it disconnects the app."""

    def __init__(
        self,
        chunks: asyncio.Queue[bytes | BaseException | None],
        task: asyncio.Task[None],
        gone: asyncio.Event,
    ) -> None:
        self._chunks, self._task, self._gone = chunks, task, gone

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._chunks.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise httpx.RemoteProtocolError(f"peer closed the stream: {item!r}")
            yield item

    async def aclose(self) -> None:
        self._gone.set()
        try:
            # Give the app a moment to see the disconnect and finish on its own.
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        except BaseException:
            pass  # the app's failure was already reported through the stream


class _SyncAppStream:
    """A sync client's view of an :class:`_AppStream` running on a portal's loop."""

    def __init__(self, stream: _AppStream, portal: BlockingPortal) -> None:
        self._stream, self._portal = stream, portal

    def __iter__(self) -> Iterator[bytes]:
        chunks = aiter(self._stream)
        while True:
            chunk = self._portal.call(_next_chunk, chunks)
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        self._portal.call(self._stream.aclose)


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    # StopAsyncIteration can't cross the portal: the end is None.
    return await anext(chunks, None)


class _Flavour:
    """The classes of one HTTP client library (``httpx`` or ``httpx2``) a response is made of:
    the client checks that a response's stream is one of its own byte streams."""

    def __init__(self, module: Any) -> None:
        self.response: Any = module.Response
        self.async_stream: Any = type("_AppStream", (_AppStream, module.AsyncByteStream), {})
        self.sync_stream: Any = type("_SyncAppStream", (_SyncAppStream, module.SyncByteStream), {})


def _flavour_of(message: object) -> _Flavour:
    """The flavour of a request or response, by the library that defines its class."""
    return _flavour(type(message).__module__.partition(".")[0])


@cache
def _flavour(library: str) -> _Flavour:
    return _Flavour(importlib.import_module(library))
