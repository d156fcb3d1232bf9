"""The fake's error answers (spendguard.testing.error_responses): each provider's envelope."""

from __future__ import annotations

import json

import anthropic
import anyio
import openai
import pytest

from spendguard.testing import ROUTES, fake_upstream
from tests.testing.wire import (
    BODIES,
    CHAT,
    EMBEDDING,
    MESSAGE,
    RECORDED,
    TIME_LIMIT,
    anthropic_client,
    keys,
    openai_client,
    raw_client,
)


@pytest.mark.anyio
async def test_fail_status_uses_the_openai_error_envelope() -> None:
    app = fake_upstream(fail_status=429)
    with anyio.fail_after(TIME_LIMIT):
        async with openai_client(app) as client:
            with pytest.raises(openai.RateLimitError) as info:
                await client.chat.completions.create(**CHAT)
        async with raw_client(fake_upstream(fail_status=503)) as client:
            response = await client.post("/v1/embeddings", json=EMBEDDING)
    assert info.value.status_code == 429
    assert info.value.code == "rate_limit_exceeded"
    recorded = json.loads((RECORDED / "openai-error-429.json").read_text())
    assert response.status_code == 503
    assert keys(response.json()) == keys(recorded)
    assert keys(response.json()["error"]) == keys(recorded["error"])
    assert response.json()["error"]["type"] == "server_error"


@pytest.mark.anyio
async def test_fail_status_uses_the_anthropic_error_envelope() -> None:
    with anyio.fail_after(TIME_LIMIT):
        async with anthropic_client(fake_upstream(fail_status=429)) as client:
            with pytest.raises(anthropic.RateLimitError) as info:
                await client.messages.create(**MESSAGE)
        async with raw_client(fake_upstream(fail_status=529)) as client:
            response = await client.post("/v1/messages", json=MESSAGE)
    assert info.value.status_code == 429
    assert info.value.body["error"]["type"] == "rate_limit_error"
    recorded = json.loads((RECORDED / "anthropic-error-429.json").read_text())
    assert response.status_code == 529
    assert list(response.json()) == list(recorded)  # type, error, request_id, in that order
    assert response.json()["error"]["type"] == "overloaded_error"
    assert response.headers["request-id"] == response.json()["request_id"]


@pytest.mark.anyio
@pytest.mark.parametrize("path", list(ROUTES))
async def test_bad_bodies_get_400_in_the_provider_envelope(path: str) -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            not_json = await client.post(path, content=b"{not json")
            no_model = await client.post(
                path, json={k: v for k, v in BODIES[path].items() if k != "model"}
            )
            not_object = await client.post(path, json=["model"])
            empty_model = await client.post(path, json={**BODIES[path], "model": ""})
            # JSON allows a lone surrogate escape; no provider takes it as a model name.
            body = json.dumps({**BODIES[path], "model": "gpt-\ud800"}).encode()
            surrogate = await client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
    for response in (not_json, no_model, not_object, empty_model, surrogate):
        assert response.status_code == 400
        payload = response.json()
        if path == "/v1/messages":
            assert payload["type"] == "error"
            assert payload["error"]["type"] == "invalid_request_error"
        else:
            assert payload["error"]["type"] == "invalid_request_error"
    assert "model" in no_model.json()["error"]["message"]
