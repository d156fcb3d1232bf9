"""Tests for spendguard.usage.tail: bounded buffering and usage/model recovery past the limit."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import pytest

from spendguard.usage import Usage, UsageObserver, openai
from spendguard.usage.tail import TailBuffer, read_ends, recover_model, recover_usage
from spendguard.usage.types import valid_model
from tests.support import bodies
from tests.support.bodies import JSON, random_chunks, retained_bytes


def observe(
    dialect: Literal["openai", "anthropic"], chunks: Iterable[bytes], max_buffer: int
) -> UsageObserver:
    return bodies.observe(dialect, JSON, chunks, max_buffer=max_buffer)


def huge_embeddings_body(size: int, usage: bytes, trailer: bytes = b"") -> bytes:
    rng = random.Random(1)
    values = b",".join(b"%.9f" % rng.uniform(-1, 1) for _ in range(4096))
    row = b'{"object":"embedding","index":0,"embedding":[' + values + b"]}"
    rows = b",".join([row] * (size // len(row) + 1))
    return (
        b'{"object":"list","data":[' + rows + b'],"model":"text-embedding-3-small",'
        b'"usage":' + usage + trailer + b"}\n"
    )


# --- through the observer -------------------------------------------------------------------


def test_huge_json_body_keeps_bounded_buffer_and_finds_usage_at_the_end() -> None:
    body = huge_embeddings_body(20 * 1024 * 1024, b'{"prompt_tokens":123456,"total_tokens":123456}')
    max_buffer = 8 * 1024 * 1024
    observer = UsageObserver("openai", JSON, max_buffer=max_buffer)
    largest = 0
    for chunk in random_chunks(body, 11, max_size=200_000):
        observer.feed(chunk)
        largest = max(largest, retained_bytes(observer))
    assert largest <= max_buffer + 4096
    assert retained_bytes(observer) <= 1024 * 1024  # only a tail is kept past the limit
    assert observer.result() == Usage(input_tokens=123456, output_tokens=0)
    assert observer.model == "text-embedding-3-small"


def test_huge_json_body_in_one_chunk() -> None:
    body = huge_embeddings_body(2 * 1024 * 1024, b'{"prompt_tokens":77,"total_tokens":77}')
    observer = observe("openai", [body], max_buffer=64 * 1024)
    assert retained_bytes(observer) <= 64 * 1024 + 4096
    assert observer.result() == Usage(input_tokens=77)


def test_tail_recovery_ignores_usage_inside_strings_and_braces_in_strings() -> None:
    usage = b'{"prompt_tokens":5,"note":"} { \\" }","total_tokens":5}'
    decoy = b',"x":"\\"usage\\": {\\"prompt_tokens\\": 999}"'
    body = huge_embeddings_body(1024 * 1024, usage, trailer=decoy)
    json.loads(body)  # the test body itself is valid JSON
    assert observe("openai", random_chunks(body, 5, 50_000), max_buffer=64 * 1024).result() == (
        Usage(input_tokens=5)
    )


def test_huge_json_without_usage_or_truncated_gives_none() -> None:
    body = huge_embeddings_body(1024 * 1024, b'{"prompt_tokens":5,"total_tokens":5}')
    without_usage = body[: body.index(b',"usage"')] + b"}"
    assert observe("openai", [without_usage], max_buffer=64 * 1024).result() is None
    truncated = body[: body.index(b'"total_tokens"')]
    assert observe("openai", [truncated], max_buffer=64 * 1024).result() is None


def test_anthropic_huge_json_tail_recovery() -> None:
    text = "word " * 400_000
    body = json.dumps(
        {
            "model": "claude-x",
            "content": [{"type": "text", "text": text}],
            "usage": {"input_tokens": 3, "cache_read_input_tokens": 8, "output_tokens": 500},
        }
    ).encode()
    observer = observe("anthropic", random_chunks(body, 2, 30_000), max_buffer=64 * 1024)
    assert observer.result() == Usage(input_tokens=3, output_tokens=500, cached_input_tokens=8)
    assert observer.model == "claude-x"


# --- the pieces themselves ------------------------------------------------------------------


def test_tail_buffer_keeps_everything_up_to_its_limit() -> None:
    buffer = TailBuffer(10, 4)
    assert buffer.empty
    buffer.append(b"0123456789")
    assert not buffer.overflowed
    assert bytes(buffer.data) == b"0123456789"
    assert buffer.head == b"0123"


def test_tail_buffer_past_its_limit_keeps_head_and_recent_tail() -> None:
    buffer = TailBuffer(8, 4)  # tail: 8 // 2 = 4 bytes, trimmed lazily at twice that
    for byte in b"abcdefghijklmnop":
        buffer.append(bytes([byte]))
        assert buffer.size <= 8 + 4
    assert buffer.overflowed
    assert not buffer.empty
    assert buffer.head == b"abcd"
    assert bytes(buffer.data).endswith(b"mnop")
    buffer.append(b"0123456789")  # a chunk longer than the tail replaces it
    assert bytes(buffer.data) == b"6789"
    buffer.clear()
    assert buffer.empty
    assert buffer.size == 0


def test_recover_usage_takes_the_last_complete_object() -> None:
    fragment = b'ng", "usage": {"a": 1}, "x": 2, "usage": {"b": {"c": "}"}}, "usage": {"d"'
    assert recover_usage(fragment) == {"b": {"c": "}"}}
    assert recover_usage(b'"usage": {"unterminated": 1') is None
    assert recover_usage(b"no usage here") is None


def test_recover_model_reads_the_first_fragment_that_names_one() -> None:
    assert recover_model(b'{"id":"x"', b'"model": "gpt-x", "model": "other"') == "gpt-x"
    assert recover_model(b'"model":"head-model"', b'"model":"tail-model"') == "head-model"
    assert recover_model(b'"model": "\x01bad"') is None
    assert recover_model(b"nothing") is None


# --- read_ends: a whole JSON body's usage and model from its two ends -----------------------

WIRE = Path(__file__).resolve().parent.parent / "fixtures" / "wire"
USAGE = b'{"prompt_tokens":11,"completion_tokens":7,"total_tokens":18}'


def whole_parse(body: bytes) -> tuple[Usage | None, str | None]:
    """What the observer reported before it read bodies from their ends."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None, None
    raw = obj.get("usage") if isinstance(obj, dict) else None
    usage = openai.normalise(raw) if isinstance(raw, dict) else None
    return usage, valid_model(obj.get("model")) if isinstance(obj, dict) else None


@pytest.mark.parametrize("name", sorted(p.name for p in WIRE.glob("*.json")))
def test_read_ends_agrees_with_a_whole_parse_on_every_recorded_body(name: str) -> None:
    body = (WIRE / name).read_bytes()
    obj = json.loads(body)
    found = read_ends(body)
    if found is not None:
        assert found == (obj["usage"], obj.get("model"))


@pytest.mark.parametrize(
    "name",
    [
        "openai-chat.json",
        "openai-chat-reasoning.json",
        "anthropic-messages.json",
        "anthropic-messages-cache-read.json",
    ],
)
def test_read_ends_reads_chat_and_message_bodies_without_the_text(name: str) -> None:
    body = (WIRE / name).read_bytes()
    obj = json.loads(body)
    assert read_ends(body) == (obj["usage"], obj["model"])
    # The generated text in the middle is not parsed: broken there, the ends still read.
    compact = json.dumps(obj).encode()
    middle = json.dumps(obj["choices"] if "choices" in obj else obj["content"]).encode()
    broken = compact.replace(middle, middle[:-1] + b'\xff"{[', 1)
    with pytest.raises(ValueError):
        json.loads(broken)
    assert read_ends(broken) == (obj["usage"], obj["model"])


@pytest.mark.parametrize(
    ("body", "found"),
    [
        # Pretty-printed, with every whitespace JSON allows.
        (b' {\r\n\t"id": "x",\n "model" : "m",\n "usage"\t:\r\n' + USAGE + b"\n}\n", "m"),
        # Keys after usage: read, and a model there is the top-level one.
        (b'{"id":"x","usage":' + USAGE + b',"model":"late","tier":"default"}', "late"),
        (b'{"model":"early","usage":' + USAGE + b',"tier":"default"}', "early"),
        (b'{"model":"m\\u00e9","usage":' + USAGE + b"}", "m\u00e9"),  # an escaped model name
        (b'{"created":1,"ok":true,"x":null,"f":-1.5e3,"model":"m","usage":' + USAGE + b"}", "m"),
    ],
)
def test_read_ends_reads_the_top_level_keys(body: bytes, found: str) -> None:
    assert read_ends(body) == (json.loads(USAGE), found)
    assert whole_parse(body) == (Usage(input_tokens=11, output_tokens=7), found)


@pytest.mark.parametrize(
    "body",
    [
        # Usage that is not the top-level object's.
        b'{"model":"m","x":{"usage":' + USAGE + b"}}",
        b'{"model":"m","choices":[{"usage":' + USAGE + b"}]}",
        b'[{"model":"m","usage":' + USAGE + b"}]",
        # "usage" as a value, after the real key: the last occurrence is not a key.
        b'{"model":"m","usage":' + USAGE + b',"type":"usage"}',
        # A key ending in an escaped quote and "usage": not the key "usage".
        b'{"model":"m","a\\"usage":' + USAGE + b"}",
        # A later usage key spelt with escapes: a whole parse takes it.
        b'{"model":"m","usage":' + USAGE + b',"\\u0075sage":{"prompt_tokens":2}}',
        # The model after a nested value: its key can't be shown top-level from the head.
        b'{"choices":[],"model":"m","usage":' + USAGE + b"}",
        b'{"usage":' + USAGE + b"}",  # no model key at all: only a whole parse can tell
        b'{"model":"m","usage":' + USAGE + b"} trailing",  # not JSON after the object
        b'{"model":"m","usage":null}',
        b'{"model":"m","usage":' + USAGE[:-5],  # truncated
        b"\xef\xbb\xbf" + b'{"model":"m","usage":' + USAGE + b"}",  # a BOM: parsed whole
    ],
)
def test_read_ends_leaves_what_it_cannot_show_to_a_whole_parse(body: bytes) -> None:
    assert read_ends(body) is None
    # ...and the observer, which then parses the body whole, reports what that parse finds.
    observer = observe("openai", [body], max_buffer=64 * 1024)
    assert (observer.result(), observer.model) == whole_parse(body)


def test_observer_counts_text_when_the_ends_report_no_usage_counts() -> None:
    body = b'{"model":"m","choices":[{"message":{"content":"' + b"x" * 40 + b'"}}],"usage":{}}'
    assert read_ends(body) == ({}, "m")
    observer = observe("openai", [body], max_buffer=64 * 1024)
    assert observer.result() is None
    assert observer.output_chars == 40  # estimation needs the text: the body was parsed whole
    assert observer.model == "m"


def test_observer_reads_usage_from_the_ends_in_any_chunking() -> None:
    body = (WIRE / "openai-chat.json").read_bytes()
    obj = json.loads(body)
    compact = json.dumps(obj).encode()
    middle = json.dumps(obj["choices"]).encode()
    broken = compact.replace(middle, middle[:-1] + b'\xff"{[', 1)  # only the ends can read it
    expected = openai.normalise(obj["usage"])
    for chunks in (random_chunks(broken, 3, 200), [broken]):
        observer = observe("openai", chunks, max_buffer=64 * 1024)
        assert observer.result() == expected
        assert observer.model == obj["model"]
        assert observer.output_chars == 0  # the text was never parsed
