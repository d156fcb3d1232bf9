"""The fake's deterministic token rule: input and output counts and the generated words.

Both the app and :func:`expected_usage` / :func:`expected_text` compute from here, so what a
test predicts is exactly what the fake answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ..usage import Usage
from .routes import Kind, kind_for_path

# Fields of the request body whose contents are "the prompt" and so count as input tokens.
_PROMPT_FIELDS: Final[Mapping[Kind, tuple[str, ...]]] = {
    "chat": ("messages", "tools", "functions"),
    "completions": ("prompt", "suffix"),
    "responses": ("instructions", "input", "tools"),
    "embeddings": ("input",),
    "messages": ("system", "messages", "tools"),
}
# Fields that cap the number of generated tokens, like the real APIs honour them.
_MAX_TOKEN_FIELDS: Final[Mapping[Kind, tuple[str, ...]]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "embeddings": (),
    "messages": ("max_tokens",),
}


def _text_units(value: object) -> int:
    """Characters of every string inside ``value`` plus 4 per integer (a token id)."""
    units = 0
    stack: list[object] = [value]
    while stack:  # iterative: a deeply nested body must not hit the recursion limit
        item = stack.pop()
        if isinstance(item, str):
            units += len(item)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            units += 4
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return units


def input_tokens(kind: Kind, body: Mapping[str, Any]) -> int:
    """ceil(units of the prompt fields / 4), at least 1."""
    units = sum(_text_units(body.get(field)) for field in _PROMPT_FIELDS[kind])
    return max(1, -(-units // 4))


def word_count(kind: Kind, body: Mapping[str, Any], chunks: int) -> int:
    """``chunks``, cut to the request's own max-tokens field when it asks for fewer."""
    words = chunks
    for field in _MAX_TOKEN_FIELDS[kind]:
        cap = body.get(field)
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
            words = min(words, cap)
    return words


def words(count: int) -> list[str]:
    """The answer's content deltas: ``"tok0"``, ``" tok1"``, ``" tok2"``..."""
    return [f"tok{i}" if i == 0 else f" tok{i}" for i in range(count)]


def expected_usage(
    path: str, body: Mapping[str, Any], *, chunks: int = 5, output_tokens: int | None = None
) -> Usage:
    """The usage the fake reports for ``body`` POSTed to ``path``, normalised like spendguard.

    ``chunks`` and ``output_tokens`` must match the app's options (or the request's
    ``x-fake-chunks`` / ``x-fake-output-tokens`` headers). The result is what the provider
    *would* bill even when the fake is told to hide usage (``report_usage=False``).
    """
    kind = kind_for_path(path)
    inp = input_tokens(kind, body)
    if kind == "embeddings":
        return Usage(input_tokens=inp)
    count = word_count(kind, body, chunks)
    return Usage(input_tokens=inp, output_tokens=count if output_tokens is None else output_tokens)


def expected_text(path: str, body: Mapping[str, Any], *, chunks: int = 5) -> str:
    """The generated text the fake answers with (empty for embeddings)."""
    kind = kind_for_path(path)
    return "" if kind == "embeddings" else "".join(words(word_count(kind, body, chunks)))
