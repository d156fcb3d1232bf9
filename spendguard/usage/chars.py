"""Counting the characters of generated text in a response, to estimate output tokens when the
provider reports no usage.

Every function takes an untrusted, already-decoded JSON value and reads anything of an unexpected
shape as no text instead of raising: a malformed body must not break the proxied response.
"""

from __future__ import annotations

import contextlib
import json


def str_len(value: object) -> int:
    return len(value) if isinstance(value, str) else 0


def content_chars(content: object) -> int:
    """Chat ``content``: a string or a list of parts with ``text``."""
    if isinstance(content, str):
        return len(content)
    total = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                total += str_len(part.get("text"))
    return total


def message_chars(message: object) -> int:
    """Chat ``message`` or stream ``delta``: text, refusal, reasoning and tool-call arguments
    are all generated (billed) output."""
    if not isinstance(message, dict):
        return 0
    total = content_chars(message.get("content"))
    total += str_len(message.get("refusal")) + str_len(message.get("reasoning_content"))
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, dict):
                total += function_chars(call.get("function"))
    return total + function_chars(message.get("function_call"))


def function_chars(function: object) -> int:
    """A tool call's ``function``: its ``arguments`` JSON text is generated output."""
    return str_len(function.get("arguments")) if isinstance(function, dict) else 0


def choices_chars(choices: object, key: str) -> int:
    """``choices[]``: chat ``message``/``delta`` under ``key``, or legacy completions ``text``."""
    total = 0
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                total += str_len(choice.get("text")) + message_chars(choice.get(key))
    return total


def responses_output_chars(output: object) -> int:
    """Responses API ``output[]`` items."""
    total = 0
    if not isinstance(output, list):
        return 0
    for item in output:
        if not isinstance(item, dict):
            continue
        total += str_len(item.get("arguments"))  # function_call items
        for key in ("content", "summary"):  # message content parts / reasoning summaries
            parts = item.get(key)
            if isinstance(parts, list):
                for part in parts:
                    if isinstance(part, dict):
                        total += str_len(part.get("text")) + str_len(part.get("refusal"))
    return total


def anthropic_content_chars(content: object) -> int:
    """Anthropic Messages ``content[]`` blocks: text, thinking and tool-use input."""
    total = 0
    if not isinstance(content, list):
        return 0
    for block in content:
        if not isinstance(block, dict):
            continue
        total += str_len(block.get("text")) + str_len(block.get("thinking"))
        tool_input = block.get("input")
        if isinstance(tool_input, dict) and tool_input:
            # Tool arguments are generated as JSON text; their serialised size approximates it.
            with contextlib.suppress(TypeError, ValueError, RecursionError):
                total += len(json.dumps(tool_input))
    return total
