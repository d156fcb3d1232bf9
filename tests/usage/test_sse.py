"""Tests for spendguard.usage.sse: assembling SSE lines into events."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spendguard.usage import Usage, UsageObserver
from spendguard.usage.lines import LineDecoder
from spendguard.usage.sse import SSEDecoder
from tests.support import bodies
from tests.support.bodies import SSE, byte_by_byte, random_chunks, sse


def observe(
    dialect: Literal["openai", "anthropic"],
    chunks: Iterable[bytes],
    *,
    max_buffer: int = 8 * 1024 * 1024,
) -> UsageObserver:
    return bodies.observe(dialect, SSE, chunks, max_buffer=max_buffer)


# --- through the observer -------------------------------------------------------------------


def test_sse_comments_padding_event_lines_and_done() -> None:
    body = (
        b": keep-alive comment\n"
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"model":"claude-x","usage":'
        b'{"input_tokens":5,"cache_read_input_tokens":7,"output_tokens":1}}}      \n'
        b"\n"
        b":\n"
        b"event: message_delta\n"
        b'data:{"type":"message_delta","usage":{"output_tokens":40}}\t \n'
        b"\n"
        b"data: [DONE]\n\n"
    )
    observer = observe("anthropic", byte_by_byte(body))
    assert observer.result() == Usage(input_tokens=5, output_tokens=40, cached_input_tokens=7)
    assert observer.model == "claude-x"


def test_sse_event_line_names_an_event_without_type() -> None:
    body = (
        b"event: message_start\n"
        b'data: {"message":{"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
        b'event: message_delta\ndata: {"usage":{"output_tokens":9}}\n\n'
    )
    assert observe("anthropic", [body]).result() == Usage(input_tokens=3, output_tokens=9)


def test_sse_utf8_character_split_across_chunks() -> None:
    text = "héllo wörld — 日本語 🎉"
    body = sse(
        {"model": "m", "choices": [{"index": 0, "delta": {"content": text}}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 12}},
        "[DONE]",
    )
    observer = observe("openai", byte_by_byte(body))
    assert observer.output_chars == len(text)  # characters, not bytes
    assert observer.result() == Usage(input_tokens=3, output_tokens=12)


def test_sse_over_long_event_recovers_usage_from_its_tail() -> None:
    # A Responses stream whose final event echoes a huge output, beyond max_buffer.
    response = {
        "model": "gpt-x",
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "y" * 500_000}]}
        ],
        "usage": {
            "input_tokens": 12,
            "input_tokens_details": {"cached_tokens": 2},
            "output_tokens": 9,
        },
        "metadata": {},
    }
    body = sse({"type": "response.completed", "response": response})
    for chunks in ([body], random_chunks(body, 4, 10_000)):
        observer = observe("openai", chunks, max_buffer=64 * 1024)
        assert observer.result() == Usage(input_tokens=10, output_tokens=9, cached_input_tokens=2)


def test_sse_invalid_event_does_not_break_the_following_ones() -> None:
    body = (
        b"data: \xff\xfe not json\n\n"
        b"data: [1, 2\n\n"
        b"data: 42\n\n"
        b"data: " + b"[" * 100_000 + b"\n\n" + sse({"choices": [], "usage": {"prompt_tokens": 9}})
    )
    assert observe("openai", [body]).result() == Usage(input_tokens=9)


# --- the decoder itself ---------------------------------------------------------------------


def test_events_join_data_lines_and_keep_the_event_name() -> None:
    decoder = SSEDecoder(4096)
    body = b"id: 1\nevent: ping\nretry: 10\ndata: a\ndata:b\ndata\nunknown: x\n\n"
    assert list(decoder.decode(body)) == [(b"a\nb\n", False, "ping")]


def test_events_without_data_and_comments_dispatch_nothing() -> None:
    decoder = SSEDecoder(4096)
    assert list(decoder.decode(b": comment\n\nevent: x\n\n\n\n")) == []
    # The event name does not leak into the next event.
    assert list(decoder.decode(b"data: y\n\n")) == [(b"y", False, "")]


def test_only_one_space_after_the_colon_is_dropped() -> None:
    decoder = SSEDecoder(4096)
    assert list(decoder.decode(b"data:  two\n\n")) == [(b" two", False, "")]


def test_events_come_out_when_their_blank_line_arrives() -> None:
    decoder = SSEDecoder(4096)
    assert list(decoder.decode(b"data: a\n")) == []
    assert list(decoder.decode(b"data: b")) == []
    assert list(decoder.decode(b"\n\ndata: c\n\n")) == [(b"a\nb", False, ""), (b"c", False, "")]


def test_pending_sees_an_unterminated_event_without_consuming_it() -> None:
    decoder = SSEDecoder(4096)
    decoder.decode(b"event: e\ndata: a\ndata: b")
    assert decoder.pending() == (b"a\nb", False, "e")
    assert decoder.pending() == (b"a\nb", False, "e")
    assert list(decoder.decode(b"c\n\n")) == [(b"a\nbc", False, "e")]
    assert decoder.pending() is None


def test_over_long_event_keeps_only_a_bounded_tail() -> None:
    decoder = SSEDecoder(4096)
    events = list(decoder.decode(b"data: " + b"x" * 10_000 + b"END\n\n"))
    assert len(events) == 1
    data, truncated, _ = events[0]
    assert truncated
    assert data.endswith(b"END")
    assert len(data) <= 4096
    assert decoder.buffered == 0


# --- whole-event chunks ---------------------------------------------------------------------

_FIELD = st.sampled_from([b"data: ", b"data:", b"event: ", b": ", b"id: ", b"data:  "])
_VALUE = st.binary(max_size=12).filter(lambda b: b"\n" not in b and b"\r" not in b)
_END = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def _streams(draw: st.DrawFn) -> list[bytes]:
    """Streams as providers send them, one event per chunk (the decoder's fast path), mixed
    with what defeats it: several lines per event, CR line ends, blank-only chunks, a BOM."""
    chunks: list[bytes] = []
    if draw(st.booleans()):
        chunks.append(b"\xef\xbb\xbf")
    for _ in range(draw(st.integers(0, 8))):
        lines = draw(st.lists(st.tuples(_FIELD, _VALUE, _END), min_size=0, max_size=3))
        end = draw(_END)
        chunks.append(b"".join(f + v + e for f, v, e in lines) + end)
    return chunks


@settings(max_examples=300, deadline=None)
@given(_streams())
def test_whole_event_chunks_decode_as_byte_by_byte_does(chunks: list[bytes]) -> None:
    def events(parts: Iterable[bytes]) -> list[tuple[bytes, bool, str]]:
        decoder = SSEDecoder(1024)
        return [event for part in parts for event in decoder.decode(part)]

    whole = b"".join(chunks)
    assert events(chunks) == events(byte_by_byte(whole))


def test_a_whole_data_event_per_chunk_is_decoded_without_the_line_splitter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoder = SSEDecoder(1024)
    monkeypatch.setattr(LineDecoder, "decode", None)  # must not be needed
    assert list(decoder.decode(b'data: {"a":1}\n\n')) == [(b'{"a":1}', False, "")]
    assert list(decoder.decode(b"data:x\n\n")) == [(b"x", False, "")]
