"""The fake upstream (spendguard.testing): wire formats, SDK round trips, usage, failure modes."""

from __future__ import annotations

import base64
import json
import math
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
import uvicorn
from starlette.types import ASGIApp, Message

from spendguard.testing import (
    ROUTES,
    FakeUpstream,
    UpstreamAborted,
    expected_text,
    expected_usage,
    fake_upstream,
)
from spendguard.usage import Usage, UsageObserver

WIRE = Path(__file__).parent / "fixtures" / "wire"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --------------------------------------------------------------------------- helpers


@asynccontextmanager
async def openai_client(app: ASGIApp) -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        base_url="http://fake/v1", api_key="x", max_retries=0, http_client=http
    ) as client:
        yield client


def _anthropic_http_client(app: ASGIApp) -> Any:
    # anthropic>=2 runs on httpx2 and refuses httpx clients; older releases use httpx.
    try:
        import httpx2
    except ImportError:  # pragma: no cover - depends on the installed SDK
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))


@asynccontextmanager
async def anthropic_client(app: ASGIApp) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url="http://fake", api_key="x", max_retries=0, http_client=_anthropic_http_client(app)
    ) as client:
        yield client


@asynccontextmanager
async def raw_client(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://fake"
    ) as client:
        yield client


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name or None, data) for each SSE event of a body."""
    events: list[tuple[str | None, str]] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        events.append((name, "\n".join(data)))
    return events


def usage_values(obj: Any) -> list[Any]:
    """Every non-null value stored under a "usage" key, at any depth."""
    found: list[Any] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("usage") is not None:
                found.append(item["usage"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def body_usages(raw: bytes, content_type: str) -> list[Any]:
    if content_type.startswith("text/event-stream"):
        values: list[Any] = []
        for _, data in sse_events(raw):
            if data != "[DONE]":
                values.extend(usage_values(json.loads(data)))
        return values
    return usage_values(json.loads(raw))


CHAT = {"model": "gpt-4o-mini-2024-07-18", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "gpt-3.5-turbo-instruct", "prompt": "Say hello to the world"}
RESPONSE = {"model": "gpt-4.1-nano", "input": "What is 2+2?", "instructions": "Be terse."}
EMBEDDING = {"model": "text-embedding-3-small", "input": ["first text", "second"]}
MESSAGE = {
    "model": "claude-sonnet-4-6",
    "max_tokens": 100,
    "system": "You are helpful.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a cat."}]}],
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSE,
    "/v1/embeddings": EMBEDDING,
    "/v1/messages": MESSAGE,
}
STREAMING_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


def streamed(path: str) -> dict[str, Any]:
    body = {**BODIES[path], "stream": True}
    if path in ("/v1/chat/completions", "/v1/completions"):
        body["stream_options"] = {"include_usage": True}
    return body


def is_content_delta(path: str, name: str | None, data: str) -> bool:
    """Whether an SSE event carries one generated word."""
    if data == "[DONE]":
        return False
    payload = json.loads(data)
    if path == "/v1/chat/completions":
        return bool(payload["choices"]) and bool(payload["choices"][0]["delta"].get("content"))
    if path == "/v1/completions":
        return bool(payload["choices"]) and bool(payload["choices"][0]["text"])
    if path == "/v1/responses":
        return name == "response.output_text.delta"
    return name == "content_block_delta"


# --------------------------------------------------------------------------- expected_usage


def test_input_tokens_follow_the_documented_rule() -> None:
    # ceil(characters of every string in the prompt fields / 4), at least 1.
    chat_units = len("user") + len("hello")
    assert expected_usage("/v1/chat/completions", CHAT).input_tokens == math.ceil(chat_units / 4)
    message_units = len("You are helpful.") + len("user") + len("text") + len("Name a cat.")
    assert expected_usage("/v1/messages", MESSAGE).input_tokens == math.ceil(message_units / 4)
    response_units = len("Be terse.") + len("What is 2+2?")
    assert expected_usage("/v1/responses", RESPONSE).input_tokens == math.ceil(response_units / 4)
    # Token-id arrays count 4 units (one token) per id.
    tokens = {"model": "m", "prompt": [11, 22, 33]}
    assert expected_usage("/v1/completions", tokens).input_tokens == 3
    # The model name and other options are not prompt text; an empty prompt still costs 1.
    assert expected_usage("/v1/chat/completions", {"model": "x" * 99, "messages": []}) == Usage(
        input_tokens=1, output_tokens=5
    )


def test_input_tokens_grow_with_the_prompt() -> None:
    short = expected_usage("/v1/embeddings", {"model": "m", "input": "a" * 40})
    long = expected_usage("/v1/embeddings", {"model": "m", "input": "a" * 41})
    assert (short.input_tokens, long.input_tokens) == (10, 11)
    assert short.output_tokens == 0


def test_output_tokens_follow_chunks_max_tokens_and_override() -> None:
    assert expected_usage("/v1/chat/completions", CHAT, chunks=7).output_tokens == 7
    capped = {**CHAT, "max_completion_tokens": 2}
    assert expected_usage("/v1/chat/completions", capped, chunks=7).output_tokens == 2
    assert expected_text("/v1/chat/completions", capped, chunks=7) == "tok0 tok1"
    assert expected_usage("/v1/messages", {**MESSAGE, "max_tokens": 3}).output_tokens == 3
    assert expected_usage("/v1/responses", {**RESPONSE, "max_output_tokens": 1}).output_tokens == 1
    reasoning = expected_usage("/v1/chat/completions", CHAT, chunks=2, output_tokens=500)
    assert reasoning.output_tokens == 500
    assert expected_text("/v1/chat/completions", CHAT, chunks=3) == "tok0 tok1 tok2"


def test_expected_usage_accepts_gateway_paths_and_rejects_others() -> None:
    direct = expected_usage("/v1/messages", MESSAGE)
    assert expected_usage("/anthropic/v1/messages?beta=true", MESSAGE) == direct
    assert expected_usage("/v1/messages/", MESSAGE) == direct
    with pytest.raises(ValueError, match="not a fake-upstream route"):
        expected_usage("/v1/models", CHAT)


def test_options_are_validated() -> None:
    for bad in (
        {"fail_status": 200},
        {"fail_status": 600},
        {"chunks": -1},
        {"stall_after": -1},
        {"stop_after": -2},
        {"output_tokens": -3},
        {"delay": -0.1},
        {"delay": float("nan")},
    ):
        with pytest.raises(ValueError):
            fake_upstream(**bad)


# --------------------------------------------------------------------------- SDK round trips


@pytest.mark.anyio
async def test_chat_completion_through_the_openai_sdk() -> None:
    app = fake_upstream(chunks=4)
    async with openai_client(app) as client:
        result = await client.chat.completions.create(**CHAT)
    want = expected_usage("/v1/chat/completions", CHAT, chunks=4)
    assert result.object == "chat.completion"
    assert result.model == CHAT["model"]
    assert result.choices[0].message.content == "tok0 tok1 tok2 tok3"
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None
    assert result.usage.prompt_tokens == want.input_tokens
    assert result.usage.completion_tokens == want.output_tokens == 4
    assert result.usage.total_tokens == want.input_tokens + want.output_tokens


@pytest.mark.anyio
async def test_chat_stream_with_usage_through_the_openai_sdk() -> None:
    app = fake_upstream(chunks=6)
    body = streamed("/v1/chat/completions")
    async with openai_client(app) as client:
        stream = await client.chat.completions.create(**body)
        chunks = [chunk async for chunk in stream]
    want = expected_usage("/v1/chat/completions", body, chunks=6)
    contents = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert contents == ["tok0", " tok1", " tok2", " tok3", " tok4", " tok5"]
    # Usage only on the last chunk, which has no choices; every other chunk has usage null.
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == want.input_tokens
    assert chunks[-1].usage.completion_tokens == want.output_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"


@pytest.mark.anyio
async def test_chat_stream_helper_accumulates_the_fake_stream() -> None:
    app = fake_upstream()
    body = {**CHAT, "stream_options": {"include_usage": True}}
    async with openai_client(app) as client, client.chat.completions.stream(**body) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.content == expected_text("/v1/chat/completions", body)
    assert final.usage is not None
    assert final.usage.prompt_tokens == expected_usage("/v1/chat/completions", body).input_tokens


@pytest.mark.anyio
async def test_chat_stream_without_include_usage_has_no_usage_key_at_all() -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(response.content)
    assert events[-1] == (None, "[DONE]")
    payloads = [json.loads(data) for _, data in events[:-1]]
    # Like the real API without stream_options: not even "usage": null.
    assert all("usage" not in p for p in payloads)
    assert all(name is None for name, _ in events)  # chat streams carry no event: lines
    async with raw_client(app) as client:
        declined = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": False}},
        )
    assert body_usages(declined.content, "text/event-stream") == []
    assert b'"usage"' not in declined.content


@pytest.mark.anyio
async def test_legacy_completions_through_the_openai_sdk() -> None:
    app = fake_upstream(chunks=3)
    async with openai_client(app) as client:
        result = await client.completions.create(**COMPLETION)
        stream = await client.completions.create(**streamed("/v1/completions"))
        chunks = [chunk async for chunk in stream]
    want = expected_usage("/v1/completions", COMPLETION, chunks=3)
    assert result.object == "text_completion"
    assert result.choices[0].text == "tok0 tok1 tok2"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        want.input_tokens,
        want.output_tokens,
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok0 tok1 tok2"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == want.input_tokens
    assert chunks[-1].usage.completion_tokens == 3


@pytest.mark.anyio
async def test_responses_through_the_openai_sdk() -> None:
    app = fake_upstream()
    want = expected_usage("/v1/responses", RESPONSE)
    async with openai_client(app) as client:
        result = await client.responses.create(**RESPONSE)
        events = [e async for e in await client.responses.create(**RESPONSE, stream=True)]
        async with client.responses.stream(**RESPONSE) as stream:
            final = await stream.get_final_response()
    assert result.status == "completed"
    assert result.output_text == expected_text("/v1/responses", RESPONSE)
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens) == (
        want.input_tokens,
        want.output_tokens,
    )
    assert events[-1].type == "response.completed"
    completed = events[-1].response
    assert completed.usage is not None and completed.usage.input_tokens == want.input_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["tok0", " tok1", " tok2", " tok3", " tok4"]
    assert final.output_text == result.output_text
    assert final.usage is not None and final.usage.output_tokens == want.output_tokens


@pytest.mark.anyio
async def test_responses_cut_by_max_output_tokens_end_incomplete() -> None:
    app = fake_upstream()
    body = {**RESPONSE, "max_output_tokens": 2}
    async with openai_client(app) as client:
        result = await client.responses.create(**body)
        events = [e async for e in await client.responses.create(**body, stream=True)]
    assert result.status == "incomplete"
    assert result.incomplete_details is not None
    assert result.incomplete_details.reason == "max_output_tokens"
    assert result.output_text == "tok0 tok1"
    assert events[-1].type == "response.incomplete"
    assert result.usage is not None and result.usage.output_tokens == 2


@pytest.mark.anyio
async def test_embeddings_through_the_openai_sdk_base64_and_float() -> None:
    app = fake_upstream()
    async with openai_client(app) as client:
        default = await client.embeddings.create(**EMBEDDING)  # the SDK asks for base64
        floats = await client.embeddings.create(**EMBEDDING, encoding_format="float", dimensions=3)
    want = expected_usage("/v1/embeddings", EMBEDDING)
    assert [d.index for d in default.data] == [0, 1]
    assert len(default.data[0].embedding) == 8
    assert default.usage.prompt_tokens == want.input_tokens == default.usage.total_tokens
    assert [len(d.embedding) for d in floats.data] == [3, 3]
    # base64 is little-endian float32 of the same vector.
    assert default.data[1].embedding[:3] == pytest.approx(floats.data[1].embedding, abs=1e-6)
    assert floats.usage.prompt_tokens == want.input_tokens


@pytest.mark.anyio
async def test_embeddings_base64_wire_encoding() -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        b64 = await client.post(
            "/v1/embeddings", json={**EMBEDDING, "encoding_format": "base64", "dimensions": 4}
        )
        floats = await client.post("/v1/embeddings", json={**EMBEDDING, "dimensions": 4})
    packed = base64.b64decode(b64.json()["data"][0]["embedding"])
    assert list(struct.unpack("<4f", packed)) == pytest.approx(
        floats.json()["data"][0]["embedding"], abs=1e-6
    )


@pytest.mark.anyio
async def test_messages_through_the_anthropic_sdk() -> None:
    app = fake_upstream(chunks=3)
    want = expected_usage("/v1/messages", MESSAGE, chunks=3)
    async with anthropic_client(app) as client:
        message = await client.messages.create(**MESSAGE)
        events = [e async for e in await client.messages.create(**MESSAGE, stream=True)]
        async with client.messages.stream(**MESSAGE) as stream:
            final = await stream.get_final_message()
    assert message.type == "message"
    assert message.model == MESSAGE["model"]
    assert message.content[0].text == "tok0 tok1 tok2"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        want.input_tokens,
        want.output_tokens,
    )
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start, delta = events[0], events[-2]
    assert start.message.usage.input_tokens == want.input_tokens
    # Like the real API, message_start only has a provisional output count.
    assert start.message.usage.output_tokens == 1
    assert delta.usage.output_tokens == want.output_tokens
    assert final.content[0].text == "tok0 tok1 tok2"
    assert final.usage.output_tokens == want.output_tokens
    assert final.usage.input_tokens == want.input_tokens


@pytest.mark.anyio
async def test_messages_capped_by_max_tokens_stop_with_max_tokens() -> None:
    app = fake_upstream()
    body = {**MESSAGE, "max_tokens": 2}
    async with anthropic_client(app) as client:
        message = await client.messages.create(**body)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 2


@pytest.mark.anyio
async def test_deterministic_and_model_echoed() -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        first = await client.post("/v1/chat/completions", json={**CHAT, "model": "My-Model"})
        second = await client.post("/v1/chat/completions", json={**CHAT, "model": "My-Model"})
    one, two = first.json(), second.json()
    assert one["model"] == "My-Model"
    assert one["usage"] == two["usage"]
    assert one["choices"] == two["choices"]
    assert one["id"] != two["id"]


# --------------------------------------------------------------------------- real wire shapes


def _keys(obj: dict[str, Any]) -> set[str]:
    return set(obj)


@pytest.mark.anyio
async def test_json_shapes_match_recorded_provider_bodies() -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        chat = (await client.post("/v1/chat/completions", json=CHAT)).json()
        responses = (await client.post("/v1/responses", json=RESPONSE)).json()
        embeddings = (await client.post("/v1/embeddings", json=EMBEDDING)).json()
        message = await client.post("/v1/messages", json=MESSAGE)
    recorded_chat = json.loads((WIRE / "openai-chat.json").read_text())
    assert _keys(chat) == _keys(recorded_chat)
    assert _keys(chat["usage"]) == _keys(recorded_chat["usage"])
    assert _keys(chat["choices"][0]) == _keys(recorded_chat["choices"][0])
    assert _keys(chat["choices"][0]["message"]) == _keys(recorded_chat["choices"][0]["message"])
    recorded_responses = json.loads((WIRE / "openai-responses.json").read_text())
    assert _keys(responses) == _keys(recorded_responses)
    assert _keys(responses["usage"]) == _keys(recorded_responses["usage"])
    recorded_embeddings = json.loads((WIRE / "openai-embeddings.json").read_text())
    assert _keys(embeddings) == _keys(recorded_embeddings)
    assert _keys(embeddings["usage"]) == _keys(recorded_embeddings["usage"])
    recorded_message = json.loads((WIRE / "anthropic-messages.json").read_text())
    # Anthropic sends compact single-line JSON.
    assert b"\n" not in message.content
    fake_message = message.json()
    assert _keys(fake_message) == _keys(recorded_message)
    assert _keys(fake_message["usage"]) <= _keys(recorded_message["usage"])
    assert {"input_tokens", "output_tokens", "cache_read_input_tokens"} <= _keys(
        fake_message["usage"]
    )


def _event_names(events: list[tuple[str | None, str]], delta_name: str) -> list[str | None]:
    """Event names with each run of content deltas collapsed to one."""
    names: list[str | None] = []
    for name, _ in events:
        if name == delta_name and names and names[-1] == delta_name:
            continue
        names.append(name)
    return names


@pytest.mark.anyio
async def test_stream_event_sequences_match_recorded_streams() -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        responses = await client.post("/v1/responses", json={**RESPONSE, "stream": True})
        messages = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
        chat = await client.post("/v1/chat/completions", json=streamed("/v1/chat/completions"))
    recorded = sse_events((WIRE / "openai-responses-stream.sse").read_bytes())
    delta = "response.output_text.delta"
    assert _event_names(sse_events(responses.content), delta) == _event_names(recorded, delta)
    recorded = sse_events((WIRE / "anthropic-messages-stream.sse").read_bytes())
    delta = "content_block_delta"
    assert _event_names(sse_events(messages.content), delta) == _event_names(recorded, delta)
    # Every Anthropic/Responses data line names its own event type.
    for body in (responses.content, messages.content):
        for name, data in sse_events(body):
            assert json.loads(data)["type"] == name
    # Chat chunks: same keys as the recorded ones (minus the random "obfuscation" padding).
    recorded_chunks = [
        json.loads(d)
        for _, d in sse_events((WIRE / "openai-chat-stream-usage.sse").read_bytes())
        if d != "[DONE]"
    ]
    chunks = [json.loads(d) for _, d in sse_events(chat.content) if d != "[DONE]"]
    assert {frozenset(c) for c in chunks} == {
        frozenset(c) - {"obfuscation"} for c in recorded_chunks
    }
    assert _keys(chunks[-1]["usage"]) == _keys(recorded_chunks[-1]["usage"])


ROUTE_MODES = [(path, False) for path in ROUTES] + [(path, True) for path in STREAMING_PATHS]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "stream"), ROUTE_MODES)
async def test_spendguard_usage_parser_reads_exactly_expected_usage(
    path: str, stream: bool
) -> None:
    body = streamed(path) if stream else BODIES[path]
    app = fake_upstream(chunks=4)
    async with raw_client(app) as client:
        response = await client.post(path, json=body)
    observer = UsageObserver(
        "anthropic" if path == "/v1/messages" else "openai", response.headers["content-type"]
    )
    for start in range(0, len(response.content), 7):  # odd chunking, like a network would
        observer.feed(response.content[start : start + 7])
    assert observer.result() == expected_usage(path, body, chunks=4)


# --------------------------------------------------------------------------- usage off, errors


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "stream"), ROUTE_MODES)
async def test_report_usage_false_omits_usage_everywhere(path: str, stream: bool) -> None:
    body = streamed(path) if stream else BODIES[path]
    async with raw_client(fake_upstream(report_usage=False)) as client:
        hidden = await client.post(path, json=body)
    async with raw_client(fake_upstream()) as client:
        shown = await client.post(path, json=body)
    assert hidden.status_code == shown.status_code == 200
    assert body_usages(hidden.content, hidden.headers["content-type"]) == []
    assert body_usages(shown.content, shown.headers["content-type"]) != []


@pytest.mark.anyio
async def test_fail_status_uses_the_openai_error_envelope() -> None:
    app = fake_upstream(fail_status=429)
    async with openai_client(app) as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(**CHAT)
    assert info.value.status_code == 429
    assert info.value.code == "rate_limit_exceeded"
    async with raw_client(fake_upstream(fail_status=503)) as client:
        response = await client.post("/v1/embeddings", json=EMBEDDING)
    recorded = json.loads((WIRE / "openai-error-429.json").read_text())
    assert response.status_code == 503
    assert _keys(response.json()) == _keys(recorded)
    assert _keys(response.json()["error"]) == _keys(recorded["error"])
    assert response.json()["error"]["type"] == "server_error"


@pytest.mark.anyio
async def test_fail_status_uses_the_anthropic_error_envelope() -> None:
    async with anthropic_client(fake_upstream(fail_status=429)) as client:
        with pytest.raises(anthropic.RateLimitError) as info:
            await client.messages.create(**MESSAGE)
    assert info.value.status_code == 429
    assert info.value.body["error"]["type"] == "rate_limit_error"
    async with raw_client(fake_upstream(fail_status=529)) as client:
        response = await client.post("/v1/messages", json=MESSAGE)
    recorded = json.loads((WIRE / "anthropic-error-429.json").read_text())
    assert response.status_code == 529
    assert list(response.json()) == list(recorded)  # type, error, request_id, in that order
    assert response.json()["error"]["type"] == "overloaded_error"
    assert response.headers["request-id"] == response.json()["request_id"]


@pytest.mark.anyio
@pytest.mark.parametrize("path", list(ROUTES))
async def test_bad_bodies_get_400_in_the_provider_envelope(path: str) -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        not_json = await client.post(path, content=b"{not json")
        no_model = await client.post(
            path, json={k: v for k, v in BODIES[path].items() if k != "model"}
        )
        not_object = await client.post(path, json=["model"])
        empty_model = await client.post(path, json={**BODIES[path], "model": ""})
    for response in (not_json, no_model, not_object, empty_model):
        assert response.status_code == 400
        payload = response.json()
        if path == "/v1/messages":
            assert payload["type"] == "error"
            assert payload["error"]["type"] == "invalid_request_error"
        else:
            assert payload["error"]["type"] == "invalid_request_error"
    assert "model" in no_model.json()["error"]["message"]


# --------------------------------------------------------------------------- header overrides


@pytest.mark.anyio
async def test_header_overrides() -> None:
    healthy, failing = fake_upstream(), fake_upstream(fail_status=500)
    async with raw_client(healthy) as client:
        fail = await client.post("/v1/chat/completions", json=CHAT, headers={"x-fake-fail": "502"})
        no_usage = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"x-fake-usage": "0"}
        )
        three = await client.post("/v1/chat/completions", json=CHAT, headers={"x-fake-chunks": "3"})
        many = await client.post(
            "/v1/messages", json=MESSAGE, headers={"x-fake-output-tokens": "321"}
        )
        bad = await client.post("/v1/messages", json=MESSAGE, headers={"x-fake-chunks": "lots"})
    async with raw_client(failing) as client:
        rescued = await client.post("/v1/chat/completions", json=CHAT, headers={"x-fake-fail": "0"})
        usage_on = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"x-fake-fail": "none", "x-fake-usage": "1"}
        )
    assert fail.status_code == 502
    assert "usage" not in no_usage.json()
    assert three.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    assert three.json()["usage"]["completion_tokens"] == 3
    assert many.json()["usage"]["output_tokens"] == 321
    assert (
        many.json()["usage"]["input_tokens"] == expected_usage("/v1/messages", MESSAGE).input_tokens
    )
    assert bad.status_code == 400
    assert "x-fake-chunks" in bad.json()["error"]["message"]
    assert rescued.status_code == 200
    assert usage_on.status_code == 200 and "usage" in usage_on.json()


@pytest.mark.anyio
async def test_delay_option_and_header() -> None:
    async with raw_client(fake_upstream(delay=0.2)) as client:
        start = anyio.current_time()
        await client.post("/v1/chat/completions", json=CHAT)
        assert anyio.current_time() - start >= 0.2
    async with raw_client(fake_upstream()) as client:
        start = anyio.current_time()
        await client.post("/v1/chat/completions", json=CHAT, headers={"x-fake-delay": "0.2"})
        assert anyio.current_time() - start >= 0.2
        bad = await client.post("/v1/chat/completions", json=CHAT, headers={"x-fake-delay": "-1"})
    assert bad.status_code == 400


@pytest.mark.anyio
async def test_received_requests_are_recorded() -> None:
    app = fake_upstream()
    async with raw_client(app) as client:
        await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "secret"})
        await client.post("/v1/embeddings", content=b"junk")
    assert app.request_count == 2
    first, second = app.received
    assert first.path == "/v1/messages"
    assert first.json() == MESSAGE
    assert first.headers["x-api-key"] == "secret"
    assert second.body == b"junk"


# --------------------------------------------------------------------------- stall / stop


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
    async with raw_client(fake_upstream()) as client:
        with anyio.fail_after(5), pytest.raises(UpstreamAborted):
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
    async with openai_client(app) as client:
        with anyio.move_on_after(0.3) as scope:
            await client.chat.completions.create(**CHAT)
    assert scope.cancelled_caught


@pytest.mark.anyio
async def test_stop_wins_over_a_later_stall() -> None:
    call = AsgiCall(
        fake_upstream(stop_after=1, stall_after=3), "/v1/messages", streamed("/v1/messages"), {}
    )
    with anyio.fail_after(5), pytest.raises(UpstreamAborted):
        await call.run()
    assert call.deltas() == 1


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
