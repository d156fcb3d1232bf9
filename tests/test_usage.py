"""Tests for spendguard.usage: usage extraction from real provider bodies, fed chunk by chunk.

Expected values come from the table "Usage values in each file" in fixtures/wire/README.md.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import pytest

from spendguard.usage import Usage, UsageObserver, estimate_usage

WIRE = Path(__file__).parent / "fixtures" / "wire"
SSE = "text/event-stream; charset=utf-8"
JSON = "application/json"

Dialect = Literal["openai", "anthropic"]

# file -> (dialect, normalised usage, model). OpenAI counts include cached tokens, so
# input = prompt - cached; Anthropic input already excludes cache reads/writes.
EXPECTED: dict[str, tuple[Dialect, Usage | None, str | None]] = {
    "openai-chat.json": (
        "openai",
        Usage(input_tokens=1149 - 1024, output_tokens=270, cached_input_tokens=1024),
        "gpt-4o-mini-2024-07-18",
    ),
    "openai-chat-reasoning.json": (
        "openai",
        Usage(input_tokens=11, output_tokens=202),
        "gpt-5-nano-2025-08-07",
    ),
    "openai-chat-stream-usage.sse": (
        "openai",
        Usage(input_tokens=78, output_tokens=9),
        "gpt-4o-mini-2024-07-18",
    ),
    "openai-chat-stream-nousage.sse": ("openai", None, "gpt-3.5-turbo-0125"),
    "openai-responses.json": (
        "openai",
        Usage(input_tokens=11, output_tokens=131),
        "gpt-5-nano-2025-08-07",
    ),
    "openai-responses-stream.sse": (
        "openai",
        Usage(input_tokens=14, output_tokens=9),
        "gpt-4.1-nano-2025-04-14",
    ),
    "openai-embeddings.json": (
        "openai",
        Usage(input_tokens=2, output_tokens=0),
        "text-embedding-ada-002-v2",
    ),
    "openai-embeddings-base64.json": (
        "openai",
        Usage(input_tokens=8, output_tokens=0),
        "text-embedding-ada-002-v2",
    ),
    "anthropic-messages.json": (
        "anthropic",
        Usage(input_tokens=17, output_tokens=100, cache_write_tokens=2056),
        "claude-sonnet-4-20250514",
    ),
    "anthropic-messages-cache-read.json": (
        "anthropic",
        Usage(input_tokens=11, output_tokens=100, cached_input_tokens=2055),
        "claude-sonnet-4-20250514",
    ),
    "anthropic-messages-stream.sse": (
        "anthropic",
        Usage(input_tokens=17, output_tokens=12),
        "claude-sonnet-4-6",
    ),
    "anthropic-messages-stream-cache-read.sse": (
        "anthropic",
        Usage(input_tokens=11, output_tokens=100, cached_input_tokens=1031),
        "claude-sonnet-4-20250514",
    ),
    "openai-error-429.json": ("openai", None, None),
    "anthropic-error-429.json": ("anthropic", None, None),
}
FIXTURES = sorted(EXPECTED)
STREAMS = [name for name in FIXTURES if name.endswith(".sse")]


def load(name: str) -> bytes:
    return (WIRE / name).read_bytes()


def content_type(name: str) -> str:
    return SSE if name.endswith(".sse") else JSON


def observe(
    dialect: Dialect, ctype: str | None, chunks: Iterable[bytes], **kw: int
) -> UsageObserver:
    observer = UsageObserver(dialect, ctype, **kw)
    for chunk in chunks:
        observer.feed(chunk)
    return observer


def random_chunks(data: bytes, seed: int, max_size: int = 97) -> list[bytes]:
    rng = random.Random(seed)
    chunks = []
    pos = 0
    while pos < len(data):
        size = rng.randint(1, max_size)
        chunks.append(data[pos : pos + size])
        pos += size
    return chunks


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def sse(*events: object, eol: str = "\n") -> bytes:
    """An SSE body from JSON-able events (or raw strings used as the data verbatim)."""
    out = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        out.append(f"data: {data}{eol}{eol}")
    return "".join(out).encode()


# --- real provider recordings ---------------------------------------------------------------


def test_fixture_files_have_no_carriage_returns() -> None:
    # The line-ending variants below are made by replacing LF; that needs pure-LF originals.
    for name in FIXTURES:
        assert b"\r" not in load(name), name


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_whole_body(name: str) -> None:
    dialect, usage, model = EXPECTED[name]
    observer = observe(dialect, content_type(name), [load(name)])
    assert observer.result() == usage
    assert observer.model == model
    if usage is not None:
        assert observer.result() is not None
        assert not observer.result().estimated  # type: ignore[union-attr]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize("split", ["bytes", "random0", "random1", "random2"])
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_any_chunking_and_line_ending(name: str, split: str, eol: bytes) -> None:
    dialect, usage, model = EXPECTED[name]
    whole = observe(dialect, content_type(name), [load(name)])
    data = load(name).replace(b"\n", eol)
    chunks = byte_by_byte(data) if split == "bytes" else random_chunks(data, int(split[-1]))
    observer = observe(dialect, content_type(name), chunks)
    assert observer.result() == usage
    assert observer.model == model
    assert observer.output_chars == whole.output_chars


STREAM_TEXT = {
    "openai-chat-stream-usage.sse": "The capital of the UK is London.",
    "openai-chat-stream-nousage.sse": (
        "Why did the opentelemetry developer go broke? Because they kept tracing their expenses!"
    ),
    "openai-responses-stream.sse": "2 + 2 equals 4.",
    "anthropic-messages-stream.sse": "**Pete** or **Scoop**",
    # Same prompt and max_tokens as the JSON recording: the same 100-token text.
    "anthropic-messages-stream-cache-read.sse": json.loads(
        load("anthropic-messages-cache-read.json")
    )["content"][0]["text"],
}


@pytest.mark.parametrize("name", STREAMS)
def test_stream_output_chars_count_generated_text(name: str) -> None:
    dialect = EXPECTED[name][0]
    observer = observe(dialect, SSE, random_chunks(load(name), 7))
    assert observer.output_chars > 0
    assert observer.output_chars == len(STREAM_TEXT[name])


def test_json_output_chars_count_generated_text() -> None:
    chat = json.loads(load("openai-chat.json"))
    expected = len(chat["choices"][0]["message"]["content"])
    assert observe("openai", JSON, [load("openai-chat.json")]).output_chars == expected
    anthropic = json.loads(load("anthropic-messages.json"))
    expected = len(anthropic["content"][0]["text"])
    assert observe("anthropic", JSON, [load("anthropic-messages.json")]).output_chars == expected
    assert observe("openai", JSON, [load("openai-responses.json")]).output_chars == len("3")


def test_stream_without_usage_gives_none_and_estimation_uses_output_chars() -> None:
    observer = observe("openai", SSE, [load("openai-chat-stream-nousage.sse")])
    assert observer.result() is None
    chars = len(STREAM_TEXT["openai-chat-stream-nousage.sse"])
    assert estimate_usage(40, observer.output_chars) == Usage(
        input_tokens=40, output_tokens=-(-chars // 4), estimated=True
    )


def test_content_type_selects_the_parser() -> None:
    body = load("openai-chat-stream-usage.sse")
    expected = EXPECTED["openai-chat-stream-usage.sse"][1]
    assert observe("openai", "Text/Event-Stream", [body]).result() == expected
    # Parsed as JSON, an SSE body is garbage.
    assert observe("openai", JSON, [body]).result() is None
    assert observe("openai", None, [body]).result() is None
    assert (
        observe("openai", None, [load("openai-chat.json")]).result()
        == (EXPECTED["openai-chat.json"][1])
    )


# --- SSE parsing details --------------------------------------------------------------------


def test_sse_crlf_split_between_chunks_does_not_end_the_event() -> None:
    # One event whose JSON spans two data lines (joined with "\n" per the SSE spec). A CRLF split
    # across chunks must not read as CR + empty line, which would dispatch half an event.
    usage = {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}
    body = (
        'data: {"choices": [],\r\ndata: "usage": '
        + json.dumps(usage)
        + "}\r\n\r\ndata: [DONE]\r\n\r\n"
    ).encode()
    for chunks in (byte_by_byte(body), [body]):
        assert observe("openai", SSE, chunks).result() == Usage(input_tokens=30, output_tokens=4)


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
    observer = observe("anthropic", SSE, byte_by_byte(body))
    assert observer.result() == Usage(input_tokens=5, output_tokens=40, cached_input_tokens=7)
    assert observer.model == "claude-x"


def test_sse_event_line_names_an_event_without_type() -> None:
    body = (
        b"event: message_start\n"
        b'data: {"message":{"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
        b'event: message_delta\ndata: {"usage":{"output_tokens":9}}\n\n'
    )
    assert observe("anthropic", SSE, [body]).result() == Usage(input_tokens=3, output_tokens=9)


def test_sse_utf8_character_split_across_chunks() -> None:
    text = "héllo wörld — 日本語 🎉"
    body = sse(
        {"model": "m", "choices": [{"index": 0, "delta": {"content": text}}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 12}},
        "[DONE]",
    )
    observer = observe("openai", SSE, byte_by_byte(body))
    assert observer.output_chars == len(text)  # characters, not bytes
    assert observer.result() == Usage(input_tokens=3, output_tokens=12)


def test_sse_leading_bom_is_ignored() -> None:
    body = "\ufeff".encode() + sse({"choices": [], "usage": {"prompt_tokens": 4}})
    assert observe("openai", SSE, byte_by_byte(body)).result() == Usage(input_tokens=4)


def test_sse_stream_ending_without_blank_line_still_counts_last_event() -> None:
    data = load("openai-chat-stream-usage.sse")
    cut = data[: data.rindex(b"\n\ndata: [DONE]")]  # ends right after the usage chunk's JSON
    assert cut.endswith(b"}")
    assert observe("openai", SSE, [cut]).result() == EXPECTED["openai-chat-stream-usage.sse"][1]


def test_result_mid_stream_does_not_consume_a_partial_event() -> None:
    data = load("openai-chat-stream-usage.sse")
    split = data.index(b'"usage":{"prompt_tokens"') + 10  # in the middle of the usage line
    observer = UsageObserver("openai", SSE)
    observer.feed(data[:split])
    assert observer.result() is None
    assert observer.output_chars == len(STREAM_TEXT["openai-chat-stream-usage.sse"])
    assert observer.model == "gpt-4o-mini-2024-07-18"
    observer.feed(data[split:])
    assert observer.result() == EXPECTED["openai-chat-stream-usage.sse"][1]


def test_openai_chat_stream_takes_usage_from_the_last_chunk_only() -> None:
    data = load("openai-chat-stream-usage.sse")
    before_usage = data[: data.index(b'"choices":[],"usage":{')]
    before_usage = before_usage[: before_usage.rindex(b"\n\n") + 2]
    assert b'"usage":null' in before_usage
    assert observe("openai", SSE, [before_usage]).result() is None


@pytest.mark.parametrize("kind", ["response.completed", "response.incomplete", "response.failed"])
def test_responses_stream_final_events_carry_usage(kind: str) -> None:
    usage = {
        "input_tokens": 50,
        "input_tokens_details": {"cached_tokens": 20},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 57,
    }
    body = sse(
        {"type": "response.created", "response": {"model": "gpt-x", "usage": None}},
        {"type": "response.output_text.delta", "delta": "Hi there"},
        {"type": "response.output_text.done", "text": "Hi there"},
        {"type": kind, "response": {"model": "gpt-x", "usage": usage}},
    )
    observer = observe("openai", SSE, random_chunks(body, 3))
    assert observer.result() == Usage(input_tokens=30, output_tokens=7, cached_input_tokens=20)
    assert observer.output_chars == len("Hi there")  # the .done event is not counted again
    assert observer.model == "gpt-x"


def test_legacy_completions_stream() -> None:
    body = sse(
        {
            "object": "text_completion",
            "model": "gpt-3.5-turbo-instruct",
            "choices": [{"text": "ab"}],
        },
        {"object": "text_completion", "choices": [{"text": "cde"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}},
        "[DONE]",
    )
    observer = observe("openai", SSE, [body])
    assert observer.output_chars == 5
    assert observer.result() == Usage(input_tokens=6, output_tokens=2)
    assert observer.model == "gpt-3.5-turbo-instruct"


def test_chat_stream_counts_tool_call_arguments() -> None:
    call = {"index": 0, "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}, "[DONE]")
    assert observe("openai", SSE, [body]).output_chars == len('{"x": 1}')


def test_anthropic_message_delta_overrides_input_and_cache_counts() -> None:
    body = sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 1}}},
        {
            "type": "message_delta",
            "usage": {
                "input_tokens": 15,
                "cache_read_input_tokens": 4,
                "cache_creation_input_tokens": 2,
                "output_tokens": 30,
            },
        },
    )
    assert observe("anthropic", SSE, [body]).result() == Usage(
        input_tokens=15, output_tokens=30, cached_input_tokens=4, cache_write_tokens=2
    )


def test_anthropic_stream_cut_before_message_delta_is_estimated() -> None:
    data = load("anthropic-messages-stream-cache-read.sse")
    cut = data[: data.index(b"event: message_delta")]
    observer = observe("anthropic", SSE, [cut])
    text = STREAM_TEXT["anthropic-messages-stream-cache-read.sse"]
    # Input and cache counts are message_start's (final); output is estimated from the text.
    assert observer.result() == Usage(
        input_tokens=11,
        output_tokens=-(-len(text) // 4),
        cached_input_tokens=1031,
        estimated=True,
    )


def test_anthropic_stream_counts_thinking_and_tool_json() -> None:
    body = sse(
        {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "hmm"}},
        {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": "{"}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "ok"}},
    )
    assert observe("anthropic", SSE, [body]).output_chars == 6


def test_sse_invalid_event_does_not_break_the_following_ones() -> None:
    body = (
        b"data: \xff\xfe not json\n\n"
        b"data: [1, 2\n\n"
        b"data: 42\n\n"
        b"data: " + b"[" * 100_000 + b"\n\n" + sse({"choices": [], "usage": {"prompt_tokens": 9}})
    )
    assert observe("openai", SSE, [body]).result() == Usage(input_tokens=9)


# --- bounded memory and tail recovery -------------------------------------------------------


def huge_embeddings_body(size: int, usage: bytes, trailer: bytes = b"") -> bytes:
    rng = random.Random(1)
    values = b",".join(b"%.9f" % rng.uniform(-1, 1) for _ in range(4096))
    row = b'{"object":"embedding","index":0,"embedding":[' + values + b"]}"
    rows = b",".join([row] * (size // len(row) + 1))
    return (
        b'{"object":"list","data":[' + rows + b'],"model":"text-embedding-3-small",'
        b'"usage":' + usage + trailer + b"}\n"
    )


def test_huge_json_body_keeps_bounded_buffer_and_finds_usage_at_the_end() -> None:
    body = huge_embeddings_body(20 * 1024 * 1024, b'{"prompt_tokens":123456,"total_tokens":123456}')
    max_buffer = 8 * 1024 * 1024
    observer = UsageObserver("openai", JSON, max_buffer=max_buffer)
    largest = 0
    for chunk in random_chunks(body, 11, max_size=200_000):
        observer.feed(chunk)
        largest = max(largest, observer._buffered_size())
    assert largest <= max_buffer + 4096
    assert observer._buffered_size() <= 1024 * 1024  # only a tail is kept past the limit
    assert observer.result() == Usage(input_tokens=123456, output_tokens=0)
    assert observer.model == "text-embedding-3-small"


def test_huge_json_body_in_one_chunk() -> None:
    body = huge_embeddings_body(2 * 1024 * 1024, b'{"prompt_tokens":77,"total_tokens":77}')
    observer = observe("openai", JSON, [body], max_buffer=64 * 1024)
    assert observer._buffered_size() <= 64 * 1024 + 4096
    assert observer.result() == Usage(input_tokens=77)


def test_tail_recovery_ignores_usage_inside_strings_and_braces_in_strings() -> None:
    usage = b'{"prompt_tokens":5,"note":"} { \\" }","total_tokens":5}'
    decoy = b',"x":"\\"usage\\": {\\"prompt_tokens\\": 999}"'
    body = huge_embeddings_body(1024 * 1024, usage, trailer=decoy)
    json.loads(body)  # the test body itself is valid JSON
    assert observe(
        "openai", JSON, random_chunks(body, 5, 50_000), max_buffer=64 * 1024
    ).result() == (Usage(input_tokens=5))


def test_huge_json_without_usage_or_truncated_gives_none() -> None:
    body = huge_embeddings_body(1024 * 1024, b'{"prompt_tokens":5,"total_tokens":5}')
    without_usage = body[: body.index(b',"usage"')] + b"}"
    assert observe("openai", JSON, [without_usage], max_buffer=64 * 1024).result() is None
    truncated = body[: body.index(b'"total_tokens"')]
    assert observe("openai", JSON, [truncated], max_buffer=64 * 1024).result() is None


def test_anthropic_huge_json_tail_recovery() -> None:
    text = "word " * 400_000
    body = json.dumps(
        {
            "model": "claude-x",
            "content": [{"type": "text", "text": text}],
            "usage": {"input_tokens": 3, "cache_read_input_tokens": 8, "output_tokens": 500},
        }
    ).encode()
    observer = observe("anthropic", JSON, random_chunks(body, 2, 30_000), max_buffer=64 * 1024)
    assert observer.result() == Usage(input_tokens=3, output_tokens=500, cached_input_tokens=8)
    assert observer.model == "claude-x"


def test_sse_absurdly_long_line_is_bounded_and_parsing_resumes() -> None:
    max_buffer = 1024 * 1024
    observer = UsageObserver("openai", SSE, max_buffer=max_buffer)
    observer.feed(b"data: ")
    for _ in range(20 * 16):  # a 20 MB line without a newline
        observer.feed(b"x" * 65536)
        assert observer._buffered_size() <= max_buffer + 64
    observer.feed(b"\n\n" + sse({"choices": [], "usage": {"prompt_tokens": 2}}))
    assert observer.result() == Usage(input_tokens=2)
    assert observer._buffered_size() == 0


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
        observer = observe("openai", SSE, chunks, max_buffer=64 * 1024)
        assert observer.result() == Usage(input_tokens=10, output_tokens=9, cached_input_tokens=2)


def test_feeding_is_linear_in_body_size() -> None:
    # An 8 MB line in 256-byte chunks: re-scanning or re-copying the partial line per chunk
    # would move ~130 GB; linear processing takes well under a second.
    observer = UsageObserver("openai", SSE)
    chunk = b"z" * 256
    started = time.perf_counter()
    observer.feed(b"data: ")
    for _ in range(32 * 1024):
        observer.feed(chunk)
    observer.feed(b"\n\n")
    assert time.perf_counter() - started < 5.0


# --- hostile and malformed input ------------------------------------------------------------


@pytest.mark.parametrize("ctype", [SSE, JSON, None])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_garbage_never_raises(dialect: Dialect, ctype: str | None) -> None:
    rng = random.Random(42)
    for _ in range(50):
        data = rng.randbytes(rng.randint(0, 3000))
        observer = observe(dialect, ctype, random_chunks(data, rng.randint(0, 99)))
        assert observer.result() is None
        assert isinstance(observer.output_chars, int)
    for data in (b"", b"\r\r\n\n\r", b"{}", b"null", b"[]", b'{"usage": 5}', b'{"usage": {}}'):
        observer = observe(dialect, ctype, [data])
        assert observer.result() is None


def test_non_bytes_chunks_never_raise() -> None:
    body = load("openai-chat.json")
    observer = UsageObserver("openai", JSON)
    observer.feed(bytearray(body[:100]))  # type: ignore[arg-type]
    observer.feed(memoryview(body)[100:])  # type: ignore[arg-type]
    assert observer.result() == EXPECTED["openai-chat.json"][1]
    broken = UsageObserver("openai", SSE)
    broken.feed("not bytes")  # type: ignore[arg-type]
    broken.feed(None)  # type: ignore[arg-type]
    assert broken.result() is None


@pytest.mark.parametrize("name", FIXTURES)
def test_truncated_bodies_never_raise(name: str) -> None:
    dialect = EXPECTED[name][0]
    data = load(name)
    for cut in range(0, len(data), max(1, len(data) // 60)):
        observer = observe(dialect, content_type(name), random_chunks(data[:cut], cut))
        result = observer.result()
        if name.endswith(".json") and data[:cut].strip() != data.strip():
            assert result is None  # a cut JSON body doesn't parse
        else:
            assert result is None or isinstance(result, Usage)


BAD_COUNTS = ["12", -5, 12.0, True, 10**12, None, [], {}, 10**100]


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
def test_malformed_openai_counts_read_as_zero(bad: object) -> None:
    usage = {
        "prompt_tokens": bad,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": bad},
    }
    body = json.dumps({"usage": usage}).encode()
    assert observe("openai", JSON, [body]).result() == Usage(input_tokens=0, output_tokens=7)
    usage = {"prompt_tokens": 10, "completion_tokens": bad}
    body = sse({"choices": [], "usage": usage})
    assert observe("openai", SSE, [body]).result() == Usage(input_tokens=10, output_tokens=0)


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
def test_malformed_anthropic_counts_read_as_zero(bad: object) -> None:
    usage = {
        "input_tokens": 4,
        "output_tokens": bad,
        "cache_read_input_tokens": bad,
        "cache_creation_input_tokens": 6,
    }
    body = json.dumps({"usage": usage}).encode()
    assert observe("anthropic", JSON, [body]).result() == Usage(
        input_tokens=4, output_tokens=0, cache_write_tokens=6
    )


def test_cached_above_prompt_is_capped() -> None:
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 50},
    }
    body = json.dumps({"usage": usage}).encode()
    assert observe("openai", JSON, [body]).result() == Usage(
        input_tokens=0, output_tokens=1, cached_input_tokens=10
    )


def test_very_long_integer_literal_never_raises() -> None:
    body = b'{"usage": {"prompt_tokens": ' + b"9" * 5000 + b"}}"
    assert observe("openai", JSON, [body]).result() is None
    assert observe("openai", SSE, [b"data: " + body + b"\n\n"]).result() is None


def test_deeply_nested_json_never_raises() -> None:
    body = b'{"usage": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert observe("openai", JSON, [body]).result() is None


# --- estimation -----------------------------------------------------------------------------


@pytest.mark.parametrize(("chars", "tokens"), [(0, 0), (1, 1), (4, 1), (5, 2), (400, 100)])
def test_estimate_usage_rounds_output_up(chars: int, tokens: int) -> None:
    assert estimate_usage(25, chars) == Usage(input_tokens=25, output_tokens=tokens, estimated=True)
