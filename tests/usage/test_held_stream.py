"""A stream's chunks are held and read from their end when usage is asked for: the answer must
be exactly the one parsing every chunk as it came gives, whatever the events and framing.

The reference is the same observer made to parse after every chunk (its held chunks drained
at once), so the two differ only in when and how much they parse.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from spendguard.usage import UsageObserver
from tests.support.bodies import SSE, load, random_chunks

MODELS = ["gpt-4o-mini-2024-07-18", "gpt-4o", "o3", "", None, 7, "bad\nmodel"]
USAGES: list[Any] = [
    None,
    {"prompt_tokens": 2, "completion_tokens": 1},
    {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
    {"prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}},
    {"total_tokens": 5},
    {"prompt_tokens": -1, "completion_tokens": 2},  # implausible: ignored
    {},
    "12",
]


def _chunk(model: object, usage: object, text: str | None, with_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1}
    if model is not None:
        chunk["model"] = model
    delta = {"content": text} if text is not None else {}
    chunk["choices"] = [] if text is None else [{"index": 0, "delta": delta}]
    if with_usage:
        chunk["usage"] = usage
    return chunk


def _response_event(kind: str, model: object, usage: object) -> dict[str, Any]:
    event: dict[str, Any] = {"response": {"model": model, "usage": usage}}
    if kind:  # else the kind is the SSE event's name (see _frame)
        event["type"] = kind
    return event


_data_event = st.one_of(
    st.builds(
        _chunk,
        st.sampled_from(MODELS),
        st.sampled_from(USAGES),
        st.one_of(st.none(), st.text(max_size=12)),
        st.booleans(),
    ),
    st.builds(
        _response_event,
        st.sampled_from(["response.created", "response.completed", "response.failed", ""]),
        st.sampled_from(MODELS),
        st.sampled_from(USAGES),
    ),
    st.just({"type": "response.output_text.delta", "delta": "hello"}),
    st.sampled_from(["[DONE]", "not json", "[1, 2]", ""]),
)


def _frame(event: object, framing: str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event)
    if framing == "plain":
        return f"data: {data}\n\n".encode()
    if framing == "nospace":
        return f"data:{data}\n\n".encode()
    if framing == "named":
        return f"event: response.completed\ndata: {data}\n\n".encode()
    if framing == "comment":
        return f": keep-alive\n\ndata: {data}\n\n".encode()
    if framing == "crlf":
        return f"data: {data}\r\n\r\n".encode()
    if framing == "split":  # the data over two lines, joined with a newline by SSE: still JSON
        head, comma, rest = data.partition(", ")
        return f"data: {head}{comma}\ndata: {rest}\n\n".encode()
    return f"data: {data}\n\n\n".encode()  # an extra blank line


_stream = st.lists(
    st.tuples(
        _data_event,
        st.sampled_from(["plain"] * 3 + ["nospace", "named", "comment", "crlf", "split", "blank"]),
    ),
    max_size=12,
)


def _observed(body: bytes, chunks: list[bytes], *, eager: bool, ask_midway: bool = False) -> Any:
    observer = UsageObserver("openai", SSE)
    for i, chunk in enumerate(chunks):
        observer.feed(chunk)
        if eager:
            observer._drain()
        if ask_midway and i == len(chunks) // 2:
            # Asking does not consume: feeding may go on and the end result is unchanged.
            observer.result()
            _ = observer.model
    return observer.result(), observer.model, observer.output_chars


def _cases(events: list[tuple[object, str]], tail: str, bom: bool) -> bytes:
    body = b"".join(_frame(event, framing) for event, framing in events)
    return (b"\xef\xbb\xbf" if bom else b"") + body + tail.encode()


@settings(max_examples=600, deadline=None)
@given(
    _stream,
    st.sampled_from(["", "data: [DONE]\n\n", 'data: {"usage": {', "data: [DONE]"]),
    st.booleans(),
    st.integers(min_value=0, max_value=10_000),
    st.booleans(),
)
def test_reading_from_the_end_gives_what_parsing_everything_gives(
    events: list[tuple[object, str]], tail: str, bom: bool, seed: int, midway: bool
) -> None:
    body = _cases(events, tail, bom)
    chunks = random_chunks(body, seed, max_size=64) if body else []
    expected = _observed(body, chunks, eager=True)
    assert _observed(body, chunks, eager=False, ask_midway=midway) == expected
    assert _observed(body, [body] if body else [], eager=False) == expected


def test_a_stream_with_usage_at_its_end_is_not_parsed_before_it() -> None:
    """The point of holding: a recorded stream with usage is answered from its last events,
    and its earlier events are never parsed (so they cost nothing while the stream passed)."""
    body = load("openai-chat-stream-usage.sse")
    observer = UsageObserver("openai", SSE)
    for chunk in random_chunks(body, 3):
        observer.feed(chunk)
    usage, model = observer.result(), observer.model
    assert usage is not None and model == "gpt-4o-mini-2024-07-18"
    assert observer._stream.output_chars == 0  # nothing was parsed in order
    assert observer.output_chars > 0  # counting the text parses them, once asked


def test_held_bytes_are_bounded() -> None:
    """Past the hold limit the chunks are parsed as they come: memory stays bounded."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 200 + b'"}}]}\n\n'
    observer = UsageObserver("openai", SSE)
    for _ in range(2_000):  # ~440 KB
        observer.feed(event)
        assert observer._buffered_size() <= 64 * 1024 + len(event)
    assert observer.output_chars == 200 * 2_000


FIRST = {"prompt_tokens": 2, "completion_tokens": 1}
LAST = {"prompt_tokens": 40, "completion_tokens": 9}


def _last_usage_framed(framing: str) -> bytes:
    """A stream whose earlier usage is overridden by a last one framed as ``framing``."""
    first = _frame(_chunk("gpt-4o", FIRST, None, True), "plain")
    last_event: dict[str, Any] = (
        _response_event("", "o3", LAST) if framing == "named" else _chunk("o3", LAST, None, True)
    )
    return first + _frame(last_event, framing) + b"data: [DONE]\n\n"


def test_the_last_report_wins_whatever_its_framing() -> None:
    """Events the end can't be read from alone (an ``event:`` name, data over several lines,
    CRLF, a comment before) are parsed in order: the last usage still wins."""
    for framing in ("plain", "nospace", "named", "comment", "crlf", "split", "blank"):
        body = _last_usage_framed(framing)
        for chunks in ([body], random_chunks(body, 1, max_size=16)):
            expected = _observed(body, chunks, eager=True)
            assert expected[0] is not None and expected[0].output_tokens == 9, framing
            assert expected[1] == "o3", framing
            assert _observed(body, chunks, eager=False) == expected, framing
