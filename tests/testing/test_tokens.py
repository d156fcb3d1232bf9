"""The fake's token rule (spendguard.testing.tokens): what expected_usage/expected_text predict."""

from __future__ import annotations

import math

import pytest

from spendguard.testing import expected_text, expected_usage
from spendguard.usage import Usage
from tests.testing.wire import CHAT, MESSAGE, RESPONSE


def test_input_tokens_follow_the_documented_rule() -> None:
    # ceil(characters of every string in the prompt fields / 4), at least 1.
    chat_units = len("user") + len("hello")
    assert expected_usage("/v1/chat/completions", CHAT).input_tokens == math.ceil(chat_units / 4)
    message_units = len("You are helpful.") + len("user") + len("text") + len("Name a cat.")
    assert expected_usage("/v1/messages", MESSAGE).input_tokens == math.ceil(message_units / 4)
    response_units = len("Be terse.") + len("What is 2+2?")
    assert expected_usage("/v1/responses", RESPONSE).input_tokens == math.ceil(response_units / 4)
    # Token-id arrays count 4 units (one token) per id.
    tokens = {"model": "m", "prompt": [11, 22, 33]}
    assert expected_usage("/v1/completions", tokens).input_tokens == 3
    # The model name and other options are not prompt text; an empty prompt still costs 1.
    assert expected_usage("/v1/chat/completions", {"model": "x" * 99, "messages": []}) == Usage(
        input_tokens=1, output_tokens=5
    )


def test_input_tokens_grow_with_the_prompt() -> None:
    short = expected_usage("/v1/embeddings", {"model": "m", "input": "a" * 40})
    long = expected_usage("/v1/embeddings", {"model": "m", "input": "a" * 41})
    assert (short.input_tokens, long.input_tokens) == (10, 11)
    assert short.output_tokens == 0


def test_output_tokens_follow_chunks_max_tokens_and_override() -> None:
    assert expected_usage("/v1/chat/completions", CHAT, chunks=7).output_tokens == 7
    capped = {**CHAT, "max_completion_tokens": 2}
    assert expected_usage("/v1/chat/completions", capped, chunks=7).output_tokens == 2
    assert expected_text("/v1/chat/completions", capped, chunks=7) == "tok0 tok1"
    assert expected_usage("/v1/messages", {**MESSAGE, "max_tokens": 3}).output_tokens == 3
    assert expected_usage("/v1/responses", {**RESPONSE, "max_output_tokens": 1}).output_tokens == 1
    reasoning = expected_usage("/v1/chat/completions", CHAT, chunks=2, output_tokens=500)
    assert reasoning.output_tokens == 500
    assert expected_text("/v1/chat/completions", CHAT, chunks=3) == "tok0 tok1 tok2"


def test_expected_usage_accepts_gateway_paths_and_rejects_others() -> None:
    direct = expected_usage("/v1/messages", MESSAGE)
    assert expected_usage("/anthropic/v1/messages?beta=true", MESSAGE) == direct
    assert expected_usage("/v1/messages/", MESSAGE) == direct
    with pytest.raises(ValueError, match="not a fake-upstream route"):
        expected_usage("/v1/models", CHAT)
