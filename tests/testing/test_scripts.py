"""The endpoint scripts (spendguard.testing.scripts): every wire format the fake speaks.

Each is checked against the official SDKs, recorded provider bodies and spendguard's own usage
parser.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import anyio
import pytest

from spendguard.testing import expected_text, expected_usage, fake_upstream
from spendguard.usage import UsageObserver
from tests.testing.wire import (
    BODIES,
    CHAT,
    COMPLETION,
    EMBEDDING,
    MESSAGE,
    RECORDED,
    RESPONSE,
    ROUTE_MODES,
    TIME_LIMIT,
    anthropic_client,
    body_usages,
    keys,
    openai_client,
    raw_client,
    sse_events,
    streamed,
)

# --------------------------------------------------------------------------- chat completions


@pytest.mark.anyio
async def test_chat_completion_through_the_openai_sdk() -> None:
    app = fake_upstream(chunks=4)
    with anyio.fail_after(TIME_LIMIT):
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
    with anyio.fail_after(TIME_LIMIT):
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
    with anyio.fail_after(TIME_LIMIT):
        async with openai_client(app) as client, client.chat.completions.stream(**body) as stream:
            final = await stream.get_final_completion()
    assert final.choices[0].message.content == expected_text("/v1/chat/completions", body)
    assert final.usage is not None
    assert final.usage.prompt_tokens == expected_usage("/v1/chat/completions", body).input_tokens


@pytest.mark.anyio
async def test_chat_stream_without_include_usage_has_no_usage_key_at_all() -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            declined = await client.post(
                "/v1/chat/completions",
                json={**CHAT, "stream": True, "stream_options": {"include_usage": False}},
            )
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(response.content)
    assert events[-1] == (None, "[DONE]")
    payloads = [json.loads(data) for _, data in events[:-1]]
    # Like the real API without stream_options: not even "usage": null.
    assert all("usage" not in p for p in payloads)
    assert all(name is None for name, _ in events)  # chat streams carry no event: lines
    assert body_usages(declined.content, "text/event-stream") == []
    assert b'"usage"' not in declined.content


# --------------------------------------------------------------------------- legacy completions


@pytest.mark.anyio
async def test_legacy_completions_through_the_openai_sdk() -> None:
    app = fake_upstream(chunks=3)
    with anyio.fail_after(TIME_LIMIT):
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


# --------------------------------------------------------------------------- responses


@pytest.mark.anyio
async def test_responses_through_the_openai_sdk() -> None:
    app = fake_upstream()
    want = expected_usage("/v1/responses", RESPONSE)
    with anyio.fail_after(TIME_LIMIT):
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
    with anyio.fail_after(TIME_LIMIT):
        async with openai_client(app) as client:
            result = await client.responses.create(**body)
            events = [e async for e in await client.responses.create(**body, stream=True)]
    assert result.status == "incomplete"
    assert result.incomplete_details is not None
    assert result.incomplete_details.reason == "max_output_tokens"
    assert result.output_text == "tok0 tok1"
    assert events[-1].type == "response.incomplete"
    assert result.usage is not None and result.usage.output_tokens == 2


# --------------------------------------------------------------------------- embeddings


@pytest.mark.anyio
async def test_embeddings_through_the_openai_sdk_base64_and_float() -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with openai_client(app) as client:
            default = await client.embeddings.create(**EMBEDDING)  # the SDK asks for base64
            floats = await client.embeddings.create(
                **EMBEDDING, encoding_format="float", dimensions=3
            )
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
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            b64 = await client.post(
                "/v1/embeddings", json={**EMBEDDING, "encoding_format": "base64", "dimensions": 4}
            )
            floats = await client.post("/v1/embeddings", json={**EMBEDDING, "dimensions": 4})
    packed = base64.b64decode(b64.json()["data"][0]["embedding"])
    assert list(struct.unpack("<4f", packed)) == pytest.approx(
        floats.json()["data"][0]["embedding"], abs=1e-6
    )


# --------------------------------------------------------------------------- anthropic messages


@pytest.mark.anyio
async def test_messages_through_the_anthropic_sdk() -> None:
    app = fake_upstream(chunks=3)
    want = expected_usage("/v1/messages", MESSAGE, chunks=3)
    with anyio.fail_after(TIME_LIMIT):
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
    with anyio.fail_after(TIME_LIMIT):
        async with anthropic_client(app) as client:
            message = await client.messages.create(**body)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 2


# --------------------------------------------------------------------------- real wire shapes


@pytest.mark.anyio
async def test_json_shapes_match_recorded_provider_bodies() -> None:
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            chat = (await client.post("/v1/chat/completions", json=CHAT)).json()
            responses = (await client.post("/v1/responses", json=RESPONSE)).json()
            embeddings = (await client.post("/v1/embeddings", json=EMBEDDING)).json()
            message = await client.post("/v1/messages", json=MESSAGE)
    recorded_chat = json.loads((RECORDED / "openai-chat.json").read_text())
    assert keys(chat) == keys(recorded_chat)
    assert keys(chat["usage"]) == keys(recorded_chat["usage"])
    assert keys(chat["choices"][0]) == keys(recorded_chat["choices"][0])
    assert keys(chat["choices"][0]["message"]) == keys(recorded_chat["choices"][0]["message"])
    recorded_responses = json.loads((RECORDED / "openai-responses.json").read_text())
    assert keys(responses) == keys(recorded_responses)
    assert keys(responses["usage"]) == keys(recorded_responses["usage"])
    recorded_embeddings = json.loads((RECORDED / "openai-embeddings.json").read_text())
    assert keys(embeddings) == keys(recorded_embeddings)
    assert keys(embeddings["usage"]) == keys(recorded_embeddings["usage"])
    recorded_message = json.loads((RECORDED / "anthropic-messages.json").read_text())
    # Anthropic sends compact single-line JSON.
    assert b"\n" not in message.content
    fake_message = message.json()
    assert keys(fake_message) == keys(recorded_message)
    assert keys(fake_message["usage"]) <= keys(recorded_message["usage"])
    assert {"input_tokens", "output_tokens", "cache_read_input_tokens"} <= keys(
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
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            responses = await client.post("/v1/responses", json={**RESPONSE, "stream": True})
            messages = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
            chat = await client.post("/v1/chat/completions", json=streamed("/v1/chat/completions"))
    recorded = sse_events((RECORDED / "openai-responses-stream.sse").read_bytes())
    delta = "response.output_text.delta"
    assert _event_names(sse_events(responses.content), delta) == _event_names(recorded, delta)
    recorded = sse_events((RECORDED / "anthropic-messages-stream.sse").read_bytes())
    delta = "content_block_delta"
    assert _event_names(sse_events(messages.content), delta) == _event_names(recorded, delta)
    # Every Anthropic/Responses data line names its own event type.
    for body in (responses.content, messages.content):
        for name, data in sse_events(body):
            assert json.loads(data)["type"] == name
    # Chat chunks: same keys as the recorded ones (minus the random "obfuscation" padding).
    recorded_chunks = [
        json.loads(d)
        for _, d in sse_events((RECORDED / "openai-chat-stream-usage.sse").read_bytes())
        if d != "[DONE]"
    ]
    chunks = [json.loads(d) for _, d in sse_events(chat.content) if d != "[DONE]"]
    assert {frozenset(c) for c in chunks} == {
        frozenset(c) - {"obfuscation"} for c in recorded_chunks
    }
    assert keys(chunks[-1]["usage"]) == keys(recorded_chunks[-1]["usage"])


# --------------------------------------------------------------------------- usage, every format


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "stream"), ROUTE_MODES)
async def test_spendguard_usage_parser_reads_exactly_expected_usage(
    path: str, stream: bool
) -> None:
    body: dict[str, Any] = streamed(path) if stream else BODIES[path]
    app = fake_upstream(chunks=4)
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(app) as client:
            response = await client.post(path, json=body)
    observer = UsageObserver(
        "anthropic" if path == "/v1/messages" else "openai", response.headers["content-type"]
    )
    for start in range(0, len(response.content), 7):  # odd chunking, like a network would
        observer.feed(response.content[start : start + 7])
    assert observer.result() == expected_usage(path, body, chunks=4)


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "stream"), ROUTE_MODES)
async def test_report_usage_false_omits_usage_everywhere(path: str, stream: bool) -> None:
    body = streamed(path) if stream else BODIES[path]
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(fake_upstream(report_usage=False)) as client:
            hidden = await client.post(path, json=body)
        async with raw_client(fake_upstream()) as client:
            shown = await client.post(path, json=body)
    assert hidden.status_code == shown.status_code == 200
    assert body_usages(hidden.content, hidden.headers["content-type"]) == []
    assert body_usages(shown.content, shown.headers["content-type"]) != []
