"""An httpx transport that runs an ASGI app in process and streams its response as it comes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.types import ASGIApp, Message


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """An httpx transport that calls an ASGI app in process and streams its response.

    ``httpx.ASGITransport`` collects the whole body before returning; this one hands chunks
    over as the app sends them, and closing the response tells the app the client left
    (``http.disconnect``), as a real server would. Used by the demo gateway to reach the fake
    upstream, and by tests that need streaming and disconnects without sockets. asyncio only.
    """

    def __init__(self, app: ASGIApp, *, client: tuple[str, int] = ("127.0.0.1", 123)) -> None:
        self.app = app
        self.client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
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
        return httpx.Response(
            start["status"], headers=headers, stream=_AppStream(chunks, task, gone)
        )


class _AppStream(httpx.AsyncByteStream):
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
