"""Tests for spendguard.usage.anthropic: Anthropic usage objects and stream events."""

from __future__ import annotations

import json

import pytest

from spendguard.usage import Usage, UsageObserver
from spendguard.usage.anthropic import normalise
from tests.support import bodies
from tests.support.bodies import JSON, SSE, load, sse

BAD_COUNTS = ["12", -5, 12.0, True, 10**12, [], {}, 10**100]


def observe(ctype: str, body: bytes) -> UsageObserver:
    return bodies.observe("anthropic", ctype, [body])


# --- streams --------------------------------------------------------------------------------


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
    assert observe(SSE, body).result() == Usage(
        input_tokens=15, output_tokens=30, cached_input_tokens=4, cache_write_tokens=2
    )


def test_anthropic_message_delta_with_only_output_keeps_message_start_counts() -> None:
    body = sse(
        {
            "type": "message_start",
            "message": {
                "usage": {"input_tokens": 10, "cache_read_input_tokens": 3, "output_tokens": 1}
            },
        },
        {"type": "message_delta", "usage": {"output_tokens": 30}},
    )
    assert observe(SSE, body).result() == Usage(
        input_tokens=10, output_tokens=30, cached_input_tokens=3
    )


def test_anthropic_stream_cut_before_message_delta_is_estimated() -> None:
    data = load("anthropic-messages-stream-cache-read.sse")
    cut = data[: data.index(b"event: message_delta")]
    observer = observe(SSE, cut)
    # Same prompt and max_tokens as the JSON recording: the same 100-token text.
    text = json.loads(load("anthropic-messages-cache-read.json"))["content"][0]["text"]
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
    assert observe(SSE, body).output_chars == 6


# --- usage objects --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
def test_a_usage_with_a_malformed_count_is_not_trusted(bad: object) -> None:
    """None: the charge falls back to the estimate from the text, as for a missing usage."""
    usage = {
        "input_tokens": 4,
        "output_tokens": bad,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 6,
    }
    body = json.dumps({"content": [{"type": "text", "text": "abcdef"}], "usage": usage})
    observer = observe(JSON, body.encode())
    assert observer.result() is None and observer.output_chars == 6
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 4, "output_tokens": 1}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": bad}}
    observer = observe(SSE, sse(start, delta))
    assert observer.result() is None


def test_normalise_maps_counts_as_they_are() -> None:
    usage = {
        "input_tokens": 5,
        "output_tokens": 6,
        "cache_read_input_tokens": 7,
        "cache_creation_input_tokens": 8,
    }
    assert normalise(usage) == Usage(
        input_tokens=5, output_tokens=6, cached_input_tokens=7, cache_write_tokens=8
    )
    assert normalise({"service_tier": "standard"}) is None
