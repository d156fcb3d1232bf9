"""Tests for spendguard.usage.observer: usage from real provider bodies, fed chunk by chunk.

Expected values come from the table "Usage values in each file" in fixtures/wire/README.md.
"""

from __future__ import annotations

import random
from typing import Literal

import pytest

from spendguard.usage import Dialect, Usage, UsageObserver, estimate_usage
from tests.support.bodies import JSON, SSE, byte_by_byte, load, observe, random_chunks

DialectName = Literal["openai", "anthropic"]

# file -> (dialect, normalised usage, model). OpenAI counts include cached tokens, so
# input = prompt - cached; Anthropic input already excludes cache reads/writes.
EXPECTED: dict[str, tuple[DialectName, Usage | None, str | None]] = {
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


def content_type(name: str) -> str:
    return SSE if name.endswith(".sse") else JSON


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


def test_dialect_enum_and_plain_strings_read_alike() -> None:
    for name in ("openai-chat-stream-usage.sse", "anthropic-messages.json"):
        dialect, usage, _ = EXPECTED[name]
        observer = UsageObserver(Dialect(dialect), content_type(name))
        observer.feed(load(name))
        assert observer.result() == usage


def test_stream_without_usage_gives_none_and_estimation_uses_output_chars() -> None:
    observer = observe("openai", SSE, [load("openai-chat-stream-nousage.sse")])
    assert observer.result() is None
    chars = len(
        "Why did the opentelemetry developer go broke? Because they kept tracing their expenses!"
    )
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
    assert observer.output_chars == len("The capital of the UK is London.")
    assert observer.model == "gpt-4o-mini-2024-07-18"
    observer.feed(data[split:])
    assert observer.result() == EXPECTED["openai-chat-stream-usage.sse"][1]


# --- hostile and malformed input ------------------------------------------------------------


@pytest.mark.parametrize("ctype", [SSE, JSON, None])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_garbage_never_raises(dialect: DialectName, ctype: str | None) -> None:
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


def test_very_long_integer_literal_never_raises() -> None:
    body = b'{"usage": {"prompt_tokens": ' + b"9" * 5000 + b"}}"
    assert observe("openai", JSON, [body]).result() is None
    assert observe("openai", SSE, [b"data: " + body + b"\n\n"]).result() is None


def test_deeply_nested_json_never_raises() -> None:
    body = b'{"usage": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert observe("openai", JSON, [body]).result() is None
