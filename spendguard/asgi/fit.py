"""Lowering a request's output cap in its body, byte for byte (design.md, "Fit instead of
refuse").

When a hard limit would refuse a request whose worst case does not fit but a smaller output cap
would, the request goes on with that cap. The body the app forwards must then say so, and
nothing else in it may change: fields spendguard does not know, their order, spacing, escapes
and number spellings are the client's. So the body is not parsed and re-serialised; its
top-level object is scanned for the cap fields and only their numbers are replaced.
"""

from __future__ import annotations

import json
from typing import Final

from starlette.types import Scope

__all__ = ["FIT_HEADER", "with_length", "with_output_cap"]

# The response header that tells the client its cap was lowered, and to what.
FIT_HEADER: Final = b"x-spendguard-fitted-max-tokens"
# The output-cap fields (asgi/request.py reads the same ones).
_CAP_FIELDS: Final = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})
_SPACE: Final = frozenset(b" \t\r\n")
_NUMBER: Final = frozenset(b"-+.0123456789eE")


def with_output_cap(body: bytes, cap: int) -> bytes | None:
    """``body`` with every top-level output-cap field above ``cap`` set to ``cap``, and not
    another byte changed; None when it has no such field (nothing to lower). ``body`` is one
    the request parser accepted: a JSON object."""
    spans: list[tuple[int, int]] = []
    i, n = _skip(body, 0), len(body)
    if i >= n or body[i] != ord("{"):
        return None
    i = _skip(body, i + 1)
    while i < n and body[i] != ord("}"):
        key_end = _string_end(body, i)
        key = json.loads(body[i:key_end])
        i = _skip(body, key_end)  # at the colon
        start = _skip(body, i + 1)
        end = _value_end(body, start)
        if key in _CAP_FIELDS and body[start] != ord("n"):  # null: no cap
            spans.append((start, end))
        i = _skip(body, end)
        if i < n and body[i] == ord(","):
            i = _skip(body, i + 1)
    lowered = [(s, e) for s, e in spans if int(body[s:e]) > cap]
    if not lowered:
        return None
    out, last, digits = bytearray(), 0, str(cap).encode()
    for start, end in lowered:
        out += body[last:start] + digits
        last = end
    return bytes(out + body[last:])


def with_length(scope: Scope, length: int) -> Scope:
    """``scope`` for a body of ``length`` bytes: its ``content-length`` says so (a proxy that
    forwards the client's headers must not announce the old length)."""
    headers = [
        (name, str(length).encode() if name == b"content-length" else value)
        for name, value in scope.get("headers", ())
    ]
    return {**scope, "headers": headers}


def _skip(body: bytes, i: int) -> int:
    while i < len(body) and body[i] in _SPACE:
        i += 1
    return i


def _string_end(body: bytes, i: int) -> int:
    """The index after the string starting at ``body[i]`` (a quote)."""
    i += 1
    while True:
        c = body[i]
        if c == 0x5C:  # a backslash escapes the next byte
            i += 2
        elif c == 0x22:
            return i + 1
        else:
            i += 1


def _value_end(body: bytes, i: int) -> int:
    """The index after the JSON value starting at ``body[i]``."""
    c = body[i]
    if c == 0x22:
        return _string_end(body, i)
    if c in (ord("{"), ord("[")):
        depth = 0
        while True:
            c = body[i]
            if c == 0x22:
                i = _string_end(body, i)
                continue
            if c in (ord("{"), ord("[")):
                depth += 1
            elif c in (ord("}"), ord("]")):
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
    if c in _NUMBER:
        while i < len(body) and body[i] in _NUMBER:
            i += 1
        return i
    for word in (b"true", b"false", b"null"):
        if body.startswith(word, i):
            return i + len(word)
    raise ValueError(f"not JSON at byte {i}")
