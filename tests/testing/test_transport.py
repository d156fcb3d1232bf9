"""StreamingASGITransport (spendguard.testing.transport).

An in-process httpx transport that streams an ASGI app's response as it is sent and tells the
app when the client leaves.
"""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard.testing import StreamingASGITransport, fake_upstream
from tests.testing.wire import EMBEDDING, TIME_LIMIT, is_content_delta, sse_events, streamed


def _client(app: ASGIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=StreamingASGITransport(app), base_url="http://fake:8080")


class _Outcome:
    """Wraps an app to record how its call ended: "returned" or the exception's name."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.ended: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except BaseException as exc:
            self.ended.append(type(exc).__name__)
            raise
        self.ended.append("returned")


@pytest.mark.anyio
async def test_the_request_reaches_the_app_as_an_asgi_http_call() -> None:
    async def echo(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        seen = {
            "method": scope["method"],
            "path": scope["path"],
            "raw_path": scope["raw_path"].decode(),
            "query_string": scope["query_string"].decode(),
            "x-test": dict(scope["headers"])[b"x-test"].decode(),
            "client": list(scope["client"]),
            "server": list(scope["server"]),
            "body": message["body"].decode(),
            "more_body": message["more_body"],
        }
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-echo", b"1")]})
        await send({"type": "http.response.body", "body": json.dumps(seen).encode()})

    with anyio.fail_after(TIME_LIMIT):
        async with _client(echo) as client:
            response = await client.put("/a/b?c=d", content=b"payload", headers={"X-Test": "yes"})
    assert response.status_code == 201
    assert response.headers["x-echo"] == "1"
    assert response.json() == {
        "method": "PUT",
        "path": "/a/b",
        "raw_path": "/a/b",
        "query_string": "c=d",
        "x-test": "yes",
        "client": ["127.0.0.1", 123],
        "server": ["fake", 8080],
        "body": "payload",
        "more_body": False,
    }


@pytest.mark.anyio
async def test_a_whole_answer_is_the_same_as_through_httpx_asgi_transport() -> None:
    with anyio.fail_after(TIME_LIMIT):
        async with _client(fake_upstream()) as client:
            streamed_here = await client.post("/v1/embeddings", json=EMBEDDING)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=fake_upstream()), base_url="http://fake"
        ) as client:
            buffered = await client.post("/v1/embeddings", json=EMBEDDING)
    assert streamed_here.status_code == buffered.status_code == 200
    assert streamed_here.headers["content-type"] == buffered.headers["content-type"]
    assert streamed_here.content == buffered.content


@pytest.mark.anyio
async def test_chunks_arrive_while_the_app_still_runs_and_closing_disconnects_it() -> None:
    # A stalled stream never finishes on its own: reading its chunks at all shows they are
    # handed over as sent, and closing the response must end the stall through http.disconnect.
    app = _Outcome(fake_upstream(stall_after=2))
    deltas = 0
    with anyio.fail_after(TIME_LIMIT):
        async with (
            _client(app) as client,
            client.stream("POST", "/v1/messages", json=streamed("/v1/messages")) as response,
        ):
            assert response.status_code == 200
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                events = sse_events(buffer)
                deltas = sum(is_content_delta("/v1/messages", n, d) for n, d in events)
                if deltas == 2:
                    break
            assert app.ended == []  # still stalled while the response is open
    assert deltas == 2
    assert app.ended == ["returned"]  # the app saw the client leave and finished on its own


@pytest.mark.anyio
async def test_an_abort_mid_stream_is_a_protocol_error_after_the_chunks_sent() -> None:
    path = "/v1/chat/completions"
    received = b""
    with anyio.fail_after(TIME_LIMIT):
        async with (
            _client(fake_upstream(stop_after=1)) as client,
            client.stream("POST", path, json=streamed(path)) as response,
        ):
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="UpstreamAborted"):
                async for chunk in response.aiter_bytes():
                    received += chunk
    assert sum(is_content_delta(path, n, d) for n, d in sse_events(received)) == 1


@pytest.mark.anyio
async def test_an_app_that_fails_before_answering_is_a_protocol_error() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    with anyio.fail_after(TIME_LIMIT):
        async with _client(broken) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="boom"):
                await client.get("/")


@pytest.mark.anyio
async def test_sending_after_the_client_left_raises_oserror_like_a_server() -> None:
    sent_late: list[str] = []

    async def talker(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the request body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        assert (await receive())["type"] == "http.disconnect"
        try:
            await send({"type": "http.response.body", "body": b"late", "more_body": False})
        except OSError as exc:
            sent_late.append(str(exc))

    app = _Outcome(talker)
    with anyio.fail_after(TIME_LIMIT):
        async with _client(app) as client, client.stream("GET", "/") as response:
            async for chunk in response.aiter_bytes():
                assert chunk == b"first"
                break  # leave with the response still open: closing it disconnects the app
    assert sent_late == ["client disconnected"]
    assert app.ended == ["returned"]


def test_a_sync_client_streams_and_closing_disconnects_the_app() -> None:
    # No event loop here: the transport runs the app on one of its own, in a thread.
    app = _Outcome(fake_upstream(stall_after=2))
    transport = StreamingASGITransport(app)
    deltas = 0
    with (
        httpx.Client(transport=transport, base_url="http://fake") as client,
        client.stream("POST", "/v1/messages", json=streamed("/v1/messages")) as response,
    ):
        assert response.status_code == 200
        buffer = b""
        for chunk in response.iter_bytes():
            buffer += chunk
            deltas = sum(is_content_delta("/v1/messages", n, d) for n, d in sse_events(buffer))
            if deltas == 2:
                break
        assert app.ended == []
    assert deltas == 2
    assert app.ended == ["returned"]


@pytest.mark.anyio
async def test_an_httpx2_client_gets_httpx2_responses() -> None:
    httpx2 = pytest.importorskip("httpx2")
    with anyio.fail_after(TIME_LIMIT):
        async with httpx2.AsyncClient(
            transport=StreamingASGITransport(fake_upstream()), base_url="http://fake"
        ) as client:
            response = await client.post("/v1/embeddings", json=EMBEDDING)
    assert isinstance(response, httpx2.Response)
    assert response.status_code == 200 and response.json()["object"] == "list"
