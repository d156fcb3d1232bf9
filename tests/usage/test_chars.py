"""Tests for spendguard.usage.chars: counting generated text, for estimation without usage."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from spendguard.usage.chars import (
    anthropic_content_chars,
    choices_chars,
    message_chars,
    responses_output_chars,
)
from tests.support.bodies import JSON, SSE, load, observe, random_chunks, sse

DialectName = Literal["openai", "anthropic"]


STREAM_TEXT: dict[str, tuple[DialectName, str]] = {
    "openai-chat-stream-usage.sse": ("openai", "The capital of the UK is London."),
    "openai-chat-stream-nousage.sse": (
        "openai",
        "Why did the opentelemetry developer go broke? Because they kept tracing their expenses!",
    ),
    "openai-responses-stream.sse": ("openai", "2 + 2 equals 4."),
    "anthropic-messages-stream.sse": ("anthropic", "**Pete** or **Scoop**"),
    # Same prompt and max_tokens as the JSON recording: the same 100-token text.
    "anthropic-messages-stream-cache-read.sse": (
        "anthropic",
        json.loads(load("anthropic-messages-cache-read.json"))["content"][0]["text"],
    ),
}


@pytest.mark.parametrize("name", sorted(STREAM_TEXT))
def test_stream_output_chars_count_generated_text(name: str) -> None:
    dialect, text = STREAM_TEXT[name]
    observer = observe(dialect, SSE, random_chunks(load(name), 7))
    assert observer.output_chars > 0
    assert observer.output_chars == len(text)


def test_json_output_chars_count_generated_text() -> None:
    chat = json.loads(load("openai-chat.json"))
    expected = len(chat["choices"][0]["message"]["content"])
    assert observe("openai", JSON, [load("openai-chat.json")]).output_chars == expected
    anthropic = json.loads(load("anthropic-messages.json"))
    expected = len(anthropic["content"][0]["text"])
    assert observe("anthropic", JSON, [load("anthropic-messages.json")]).output_chars == expected
    assert observe("openai", JSON, [load("openai-responses.json")]).output_chars == len("3")


def test_chat_stream_counts_tool_call_arguments() -> None:
    call = {"index": 0, "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}, "[DONE]")
    assert observe("openai", SSE, [body]).output_chars == len('{"x": 1}')


# --- the counting functions themselves ------------------------------------------------------


def test_message_counts_every_kind_of_generated_text() -> None:
    message = {
        "content": [{"type": "text", "text": "abc"}, {"type": "image"}, "junk"],
        "refusal": "no",
        "reasoning_content": "think",
        "tool_calls": [{"function": {"arguments": "{}"}}, "junk", {"function": None}],
        "function_call": {"arguments": "[1]"},
    }
    assert message_chars(message) == len("abc") + len("no") + len("think") + 2 + 3
    assert message_chars({"content": "plain"}) == 5


def test_choices_count_legacy_text_and_messages_under_the_key() -> None:
    choices = [{"text": "ab"}, {"delta": {"content": "cde"}}, {"message": {"content": "x"}}, 7]
    assert choices_chars(choices, "delta") == 5
    assert choices_chars(choices, "message") == 3


def test_responses_output_counts_text_refusals_summaries_and_arguments() -> None:
    output = [
        {"type": "message", "content": [{"text": "hello"}, {"refusal": "no"}]},
        {"type": "reasoning", "summary": [{"text": "why"}]},
        {"type": "function_call", "arguments": '{"a":1}'},
        None,
    ]
    assert responses_output_chars(output) == 5 + 2 + 3 + 7


def test_anthropic_content_counts_text_thinking_and_tool_input() -> None:
    content = [
        {"type": "text", "text": "hi"},
        {"type": "thinking", "thinking": "hmm"},
        {"type": "tool_use", "input": {"q": 1}},
        {"type": "tool_use", "input": {}},
        "junk",
    ]
    assert anthropic_content_chars(content) == 2 + 3 + len(json.dumps({"q": 1}))


@pytest.mark.parametrize("junk", [None, 5, "text", {"a": 1}, [None, 3, []]])
def test_unexpected_shapes_count_as_nothing(junk: object) -> None:
    assert message_chars(junk if isinstance(junk, dict) else None) == 0
    assert choices_chars(junk, "delta") == 0
    assert responses_output_chars(junk) == 0
    assert anthropic_content_chars(junk) == 0
