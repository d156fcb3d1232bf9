"""Tests for spendguard.usage.openai: OpenAI usage objects and stream events."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest

from spendguard.usage import Usage, UsageObserver
from spendguard.usage.openai import normalise
from tests.support import bodies
from tests.support.bodies import JSON, SSE, WIRE, random_chunks, sse

BAD_COUNTS = ["12", -5, 12.0, True, 10**12, [], {}, 10**100]


def observe(ctype: str, chunks: Iterable[bytes]) -> UsageObserver:
    return bodies.observe("openai", ctype, chunks)


# --- streams --------------------------------------------------------------------------------


def test_openai_chat_stream_takes_usage_from_the_last_chunk_only() -> None:
    data = (WIRE / "openai-chat-stream-usage.sse").read_bytes()
    before_usage = data[: data.index(b'"choices":[],"usage":{')]
    before_usage = before_usage[: before_usage.rindex(b"\n\n") + 2]
    assert b'"usage":null' in before_usage
    assert observe(SSE, [before_usage]).result() is None


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
    observer = observe(SSE, random_chunks(body, 3))
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
    observer = observe(SSE, [body])
    assert observer.output_chars == 5
    assert observer.result() == Usage(input_tokens=6, output_tokens=2)
    assert observer.model == "gpt-3.5-turbo-instruct"


# --- usage objects --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
def test_a_usage_with_a_malformed_count_is_not_trusted(bad: object) -> None:
    """None: the charge falls back to the estimate from the text, as for a missing usage."""
    for usage in (
        {"prompt_tokens": bad, "completion_tokens": 7},
        {
            "prompt_tokens": 10,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": bad},
        },
        {"input_tokens": 10, "output_tokens": bad},
    ):
        body = json.dumps({"choices": [{"message": {"content": "abcdefgh"}}], "usage": usage})
        observer = observe(JSON, [body.encode()])
        assert observer.result() is None and observer.output_chars == 8
        stream = sse({"choices": [{"delta": {"content": "abcd"}}]}, {"choices": [], "usage": usage})
        observer = observe(SSE, [stream])
        assert observer.result() is None and observer.output_chars == 4


def test_null_counts_read_as_zero() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": None, "prompt_tokens_details": None}
    body = json.dumps({"usage": usage}).encode()
    assert observe(JSON, [body]).result() == Usage(input_tokens=10, output_tokens=0)


def test_cached_above_prompt_is_capped() -> None:
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 50},
    }
    body = json.dumps({"usage": usage}).encode()
    assert observe(JSON, [body]).result() == Usage(
        input_tokens=0, output_tokens=1, cached_input_tokens=10
    )


def test_normalise_chat_and_responses_shapes() -> None:
    chat = {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert normalise(chat) == Usage(input_tokens=5, output_tokens=2, cached_input_tokens=4)
    responses = {
        "input_tokens": 9,
        "output_tokens": 2,
        "input_tokens_details": {"cached_tokens": 1},
    }
    assert normalise(responses) == Usage(input_tokens=8, output_tokens=2, cached_input_tokens=1)


def test_normalise_only_a_total_counts_the_rest_as_prompt() -> None:
    assert normalise({"total_tokens": 12, "completion_tokens": 5}) == Usage(
        input_tokens=7, output_tokens=5
    )
    assert normalise({"total_tokens": 3, "completion_tokens": 5}) == Usage(output_tokens=5)


def test_normalise_without_any_count_is_none() -> None:
    assert normalise({}) is None
    assert normalise({"input_tokens_details": {"cached_tokens": 3}}) is None
