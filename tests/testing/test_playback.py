"""Stalls and aborts (spendguard.testing.playback).

Driven over raw ASGI, through httpx and the SDK, and behind a real uvicorn server.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import openai
import pytest
import uvicorn
from starlette.types import ASGIApp, Message

from spendguard.testing import FakeUpstream, UpstreamAborted, fake_upstream
from tests.testing.wire import (
    CHAT,
    MESSAGE,
    STREAMING_PATHS,
    TIME_LIMIT,
    body_usages,
    is_content_delta,
    openai_client,
    raw_client,
    sse_events,
    streamed,
)


class AsgiCall:
    """Drives the app directly, recording every message it sends."""

    def __init__(self, app: ASGIApp, path: str, body: dict[str, Any], headers: dict[str, str]):
        self.app, self.path = app, path
        self.raw = json.dumps(body).encode()
        self.headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        self.sent: list[Message] = []
        self.disconnected = anyio.Event()
        self._body_sent = False
        self.wanted_deltas = -1
        self.reached = anyio.Event()  # set once wanted_deltas content chunks were sent

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), *self.headers],
            "client": ("127.0.0.1", 1234),
            "server": ("fake", 80),
        }

    async def receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.raw, "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if self.wanted_deltas >= 0 and self.deltas() >= self.wanted_deltas:
            self.reached.set()

    async def run(self) -> None:
        await self.app(self.scope(), self.receive, self.send)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def deltas(self) -> int:
        return sum(is_content_delta(self.path, n, d) for n, d in sse_events(self.body))


STREAM_CASES = [pytest.param(path, id=path[len("/v1/") :]) for path in STREAMING_PATHS]


# --------------------------------------------------------------------------- stop


@pytest.mark.anyio
@pytest.mark.parametrize("path", STREAM_CASES)
@pytest.mark.parametrize("n", [0, 2, 9])
async def test_stop_after_cuts_the_stream_after_n_content_chunks(path: str, n: int) -> None:
    call = AsgiCall(fake_upstream(stop_after=n), path, streamed(path), {})
    with anyio.fail_after(5), pytest.raises(UpstreamAborted):
        await call.run()
    assert call.sent[0]["type"] == "http.response.start" and call.sent[0]["status"] == 200
    # Every body message announced more to come: the response never ended cleanly.
    assert all(m.get("more_body") for m in call.sent[1:])
    assert call.deltas() == min(n, 5)
    assert b"[DONE]" not in call.body
    if path != "/v1/messages":
        assert body_usages(call.body, "text/event-stream") == []
    else:
        # Only message_start's provisional usage made it; never the final message_delta.
        names = [name for name, _ in sse_events(call.body)]
        assert "message_delta" not in names and "message_stop" not in names


@pytest.mark.anyio
async def test_stop_after_surfaces_in_an_asgi_client_and_via_header() -> None:
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(fake_upstream()) as client:
            with pytest.raises(UpstreamAborted):
                await client.post(
                    "/v1/chat/completions",
                    json=streamed("/v1/chat/completions"),
                    headers={"x-fake-stop-after": "1"},
                )
            ok = await client.post("/v1/chat/completions", json=streamed("/v1/chat/completions"))
    assert ok.status_code == 200


@pytest.mark.anyio
async def test_stop_after_on_a_json_response_sends_half_the_body() -> None:
    call = AsgiCall(fake_upstream(), "/v1/messages", MESSAGE, {"x-fake-stop-after": "3"})
    with anyio.fail_after(5), pytest.raises(UpstreamAborted):
        await call.run()
    with anyio.fail_after(5):
        full = await _full_body("/v1/messages", MESSAGE)
    assert call.sent[0]["status"] == 200
    assert 0 < len(call.body) < len(full)
    assert full.startswith(call.body)
    assert call.sent[-1]["more_body"] is True


async def _full_body(path: str, body: dict[str, Any]) -> bytes:
    call = AsgiCall(fake_upstream(), path, body, {})
    await call.run()
    return call.body


@pytest.mark.anyio
async def test_stop_wins_over_a_later_stall() -> None:
    call = AsgiCall(
        fake_upstream(stop_after=1, stall_after=3), "/v1/messages", streamed("/v1/messages"), {}
    )
    with anyio.fail_after(5), pytest.raises(UpstreamAborted):
        await call.run()
    assert call.deltas() == 1


# --------------------------------------------------------------------------- stall


@pytest.mark.anyio
@pytest.mark.parametrize("path", STREAM_CASES)
async def test_stall_after_streams_n_chunks_then_waits_for_disconnect(path: str) -> None:
    call = AsgiCall(fake_upstream(), path, streamed(path), {"x-fake-stall-after": "2"})
    call.wanted_deltas = 2
    finished = anyio.Event()

    async def run() -> None:
        await call.run()
        finished.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await call.reached.wait()
            await anyio.sleep(0.2)  # long enough for more chunks, were any coming
            assert call.deltas() == 2
            assert not finished.is_set()
            assert all(m.get("more_body") for m in call.sent[1:])
            call.disconnected.set()  # the client goes away: the stall must end promptly
            await finished.wait()
    assert call.deltas() == 2


@pytest.mark.anyio
async def test_stall_on_a_json_request_never_starts_a_response() -> None:
    call = AsgiCall(fake_upstream(stall_after=0), "/v1/chat/completions", CHAT, {})
    with anyio.move_on_after(0.3) as scope:
        await call.run()
    assert scope.cancelled_caught  # still waiting when the timeout cancelled it
    assert call.sent == []


@pytest.mark.anyio
async def test_stall_through_the_sdk_is_bounded_by_the_callers_timeout() -> None:
    app = fake_upstream(stall_after=1)
    with anyio.fail_after(TIME_LIMIT):
        async with openai_client(app) as client:
            with anyio.move_on_after(0.3) as scope:
                await client.chat.completions.create(**CHAT)
    assert scope.cancelled_caught


@pytest.mark.anyio
async def test_a_vanished_client_ends_the_stream_quietly() -> None:
    # ASGI 2.4 servers raise OSError from send() once the client has gone.
    call = AsgiCall(fake_upstream(chunks=50), "/v1/messages", streamed("/v1/messages"), {})
    record = call.send

    async def send(message: Message) -> None:
        if len(call.sent) >= 3:
            raise OSError("client disconnected")
        await record(message)

    call.send = send  # type: ignore[method-assign]
    with anyio.fail_after(5):
        await call.run()  # no exception escapes
    assert len(call.sent) == 3


# --------------------------------------------------------------------------- behind a real server


@asynccontextmanager
async def served(app: FakeUpstream) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        with anyio.fail_after(5):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
    sock.close()


@pytest.mark.anyio
async def test_stop_after_aborts_the_connection_behind_uvicorn() -> None:
    app = fake_upstream(stop_after=2)
    with anyio.fail_after(15):
        await _stop_behind_uvicorn(app)


async def _stop_behind_uvicorn(app: FakeUpstream) -> None:
    received: list[str] = []
    async with (
        served(app) as base,
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client,
    ):
        with pytest.raises((httpx.HTTPError, openai.APIError)):
            stream = await client.chat.completions.create(**streamed("/v1/chat/completions"))
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received.append(chunk.choices[0].delta.content)
    assert received == ["tok0", " tok1"]


@pytest.mark.anyio
async def test_stall_behind_uvicorn_ends_when_the_client_gives_up() -> None:
    # The outer bound also covers server shutdown, which waits for the stalled handler: it only
    # finishes because the stall ends when the client disconnects.
    with anyio.fail_after(15):
        lines = await _stall_behind_uvicorn(fake_upstream(stall_after=1))
    deltas = [line for line in lines if line == "event: content_block_delta"]
    assert len(deltas) == 1


async def _stall_behind_uvicorn(app: FakeUpstream) -> list[str]:
    lines: list[str] = []
    async with (
        served(app) as base,
        httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(5, read=0.3)) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream(
                "POST", "/v1/messages", json=streamed("/v1/messages")
            ) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
    return lines
