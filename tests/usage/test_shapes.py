"""Tests for spendguard.usage.shapes: text deltas counted from their bytes, exactly as a parse.

The reference everywhere is the dialect's own stream fed every event's parsed JSON: whatever
the observer counts without parsing must equal it, on recorded provider streams and on
generated ones full of the texts a shape must refuse.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spendguard.usage import observer as observer_module
from spendguard.usage.anthropic import AnthropicStream
from spendguard.usage.openai import OpenAIStream
from spendguard.usage.shapes import DeltaShape, learn
from tests.support.bodies import SSE, load, observe, random_chunks

CHUNK = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini",'
    '"choices":[{"index":0,"delta":{"content":%s},"finish_reason":null}],"usage":null}'
)


def chunk(text: str, *, ascii_only: bool = True) -> bytes:
    return (CHUNK % json.dumps(text, ensure_ascii=ascii_only)).encode()


def shape_of(text: str) -> DeltaShape:
    shape = learn(chunk(text), "", text, len(text), "gpt-4o-mini")
    assert shape is not None
    return shape


def reference(dialect: str, body: bytes) -> tuple[int, str | None, Any]:
    """Characters, model and usage from parsing every event of an SSE body."""
    stream: OpenAIStream | AnthropicStream = (
        OpenAIStream() if dialect == "openai" else AnthropicStream()
    )
    name = ""
    for raw in body.replace(b"\r\n", b"\n").split(b"\n"):  # SSE line ends only, not str's
        line = raw.decode()
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:") and line[5:].strip() != "[DONE]":
            obj = json.loads(line[5:])
            kind = obj.get("type")
            stream.apply(obj, kind if isinstance(kind, str) else name)
        elif not line:
            name = ""
    return stream.output_chars, stream.model, stream.result()


def test_a_learned_shape_counts_other_texts_between_the_same_bytes() -> None:
    shape = shape_of("Hello")
    assert shape.chars(chunk(" world")) == 6
    assert shape.chars(chunk("")) == 0
    assert shape.chars(chunk("héllo wörld ✓", ascii_only=False)) == 13  # characters, not bytes
    assert shape.chars(chunk("🙂", ascii_only=False)) == 1


@pytest.mark.parametrize(
    "payload",
    [
        chunk('say "hi"'),  # an escaped quote: only a parse knows the text
        chunk("a\nb"),  # an escape again
        chunk("é"),  # \u00e9: escaped non-ASCII
        chunk("tok").replace(b'"usage":null', b'"usage":{"prompt_tokens":1}'),  # other bytes
        chunk("tok").replace(b'"created":1', b'"created":2'),
        chunk("tok").replace(b"tok", b"t\x01k"),  # a raw control character: invalid JSON
        chunk("tok").replace(b"tok", b"t\xffk"),  # not UTF-8: invalid SSE
        chunk("tok").replace(b"tok", b"t\\k"),
        b"[DONE]",
        b"",
    ],
)
def test_anything_but_a_plain_text_between_the_same_bytes_is_left_to_a_parse(
    payload: bytes,
) -> None:
    assert shape_of("Hello").chars(payload) is None


def test_no_shape_where_the_text_can_not_be_located_with_certainty() -> None:
    assert learn(chunk(""), "", "", 0, None) is None  # nothing to locate
    assert learn(chunk('a "b"'), "", 'a "b"', 5, None) is None  # escapes in the event
    # The same text elsewhere in the event: which one is the delta?
    twice = chunk("gpt-4o-mini")
    assert learn(twice, "", "gpt-4o-mini", 11, None) is None


def test_other_characters_of_the_event_are_counted_with_its_text() -> None:
    payload = chunk("ab").replace(b'"content":"ab"', b'"content":"ab","refusal":"no"')
    shape = learn(payload, "", "ab", 4, None)
    assert shape is not None
    assert shape.chars(payload.replace(b'"ab"', b'"abc"')) == 5


@pytest.mark.parametrize(
    ("dialect", "name"),
    [
        ("openai", "openai-chat-stream-usage.sse"),
        ("openai", "openai-chat-stream-nousage.sse"),
        ("openai", "openai-responses-stream.sse"),
        ("anthropic", "anthropic-messages-stream.sse"),
        ("anthropic", "anthropic-messages-stream-cache-read.sse"),
    ],
)
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_recorded_streams_are_observed_as_a_parse_of_every_event_would(
    dialect: str, name: str, seed: int | None
) -> None:
    body = load(name)
    chunks = [body] if seed is None else random_chunks(body, seed)
    observer = observe(dialect, SSE, chunks)
    chars, model, usage = reference(dialect, body)
    assert (observer.output_chars, observer.model, observer.result()) == (chars, model, usage)


def openai_event(text: str, model: str, ascii_only: bool) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9",
        "object": "chat.completion.chunk",
        "model": model,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        "usage": None,
    }


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(st.text(max_size=12), max_size=25),
    models=st.lists(st.sampled_from(["gpt-4o", "gpt-4o-mini", "", " "]), min_size=1),
    ascii_only=st.booleans(),
    with_usage=st.booleans(),
    seed=st.integers(0, 3),
)
def test_generated_chat_streams_are_observed_as_a_parse_of_every_event_would(
    texts: list[str], models: list[str], ascii_only: bool, with_usage: bool, seed: int
) -> None:
    events = [
        json.dumps(openai_event(text, models[i % len(models)], ascii_only), ensure_ascii=ascii_only)
        for i, text in enumerate(texts)
    ]
    if with_usage:
        events.append(
            json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
        )
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    observer = observe("openai", SSE, random_chunks(body, seed, max_size=400))
    chars, model, usage = reference("openai", body)
    assert (observer.output_chars, observer.model, observer.result()) == (chars, model, usage)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.text(max_size=12), max_size=25), key=st.sampled_from(["text", "thinking"]))
def test_generated_anthropic_streams_are_observed_as_a_parse_of_every_event_would(
    texts: list[str], key: str
) -> None:
    start = {"type": "message_start", "message": {"model": "claude", "usage": {"input_tokens": 5}}}
    events = [("message_start", start)]
    for text in texts:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "x", key: text}}
        events.append(("content_block_delta", delta))
    body = "".join(f"event: {n}\ndata: {json.dumps(e)}\n\n" for n, e in events).encode()
    observer = observe("anthropic", SSE, [body])
    assert (observer.output_chars, observer.model, observer.result()) == reference(
        "anthropic", body
    )


def test_a_long_stream_is_parsed_only_where_its_shape_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = b"".join(b"data: " + chunk(f" tok{i}") + b"\n\n" for i in range(500))
    parses = 0
    loads = json.loads

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal parses
        parses += 1
        return loads(*args, **kwargs)

    class CountingDecoder(json.JSONDecoder):
        def decode(self, s: str, *args: Any, **kwargs: Any) -> Any:
            nonlocal parses
            parses += 1
            return super().decode(s, *args, **kwargs)

    # Every way the observer parses JSON: json.loads, and its own decoder.
    monkeypatch.setattr(json, "loads", counting)
    monkeypatch.setattr(observer_module, "_JSON", CountingDecoder())
    observer = observe("openai", SSE, [body[i : i + 4096] for i in range(0, len(body), 4096)])
    assert observer.output_chars == sum(len(f" tok{i}") for i in range(500))
    assert parses == 1  # the first delta; the other 499 have its shape
