"""The fake provider app (spendguard.testing.upstream): routing, recording, ids and echoes."""

from __future__ import annotations

import anyio
import pytest

from spendguard.testing import ROUTES, ReceivedRequest, fake_upstream
from tests.testing.wire import BODIES, CHAT, MESSAGE, TIME_LIMIT, raw_client


@pytest.mark.anyio
async def test_received_requests_are_recorded() -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "secret"})
            await client.post("/v1/embeddings", content=b"junk")
    assert app.request_count == 2
    first, second = app.received
    assert isinstance(first, ReceivedRequest)
    assert first.path == "/v1/messages"
    assert first.json() == MESSAGE
    assert first.headers["x-api-key"] == "secret"
    assert second.body == b"junk"


@pytest.mark.anyio
async def test_deterministic_and_model_echoed() -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            first = await client.post("/v1/chat/completions", json={**CHAT, "model": "My-Model"})
            second = await client.post("/v1/chat/completions", json={**CHAT, "model": "My-Model"})
    one, two = first.json(), second.json()
    assert one["model"] == "My-Model"
    assert one["usage"] == two["usage"]
    assert one["choices"] == two["choices"]
    assert one["id"] != two["id"]


@pytest.mark.anyio
async def test_every_route_answers_post_only_with_its_own_ids() -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            answers = {path: await client.post(path, json=BODIES[path]) for path in ROUTES}
            get = await client.get("/v1/chat/completions")
            unknown = await client.post("/v1/models", json=CHAT)
    assert get.status_code == 405
    assert unknown.status_code == 404
    assert app.request_count == len(ROUTES)  # only requests that reached a route count
    prefixes = {
        "/v1/chat/completions": "chatcmpl-fake",
        "/v1/completions": "cmpl-fake",
        "/v1/responses": "resp_fake",
        "/v1/embeddings": None,  # an embeddings list has no id
        "/v1/messages": "msg_fake",
    }
    for serial, (path, response) in enumerate(answers.items(), start=1):
        assert response.status_code == 200
        request_id = f"req_fake{serial:012d}"
        header = "request-id" if path == "/v1/messages" else "x-request-id"
        assert response.headers[header] == request_id
        prefix = prefixes[path]
        if prefix is not None:
            assert response.json()["id"] == f"{prefix}{serial:012d}"
