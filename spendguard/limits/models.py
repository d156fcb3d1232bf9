"""Which models a key or a team may call: exact names or globs (``gpt-4o*``, ``claude-?-*``).

A list is kept per API key and per team; a request must match every list that exists for it
(its key's and its team's). No list: every model. The lists live in the ledger and are cached
in the team's policy hash next to its limits (``allow:`` + key, ``allow:`` for the team), as
the globs joined by newlines; the preflight script matches them before it touches any counter.

Globs: ``*`` is any run of characters, ``?`` any one byte; everything else matches itself (no
character classes). Matching is on the UTF-8 bytes, the same in the Lua script and here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Final

ALLOW_PREFIX: Final = "allow:"
MAX_PATTERN_LENGTH: Final = 256
MAX_PATTERNS: Final = 200


def allow_field(api_key: str | None) -> str:
    """The policy-hash field of a key's list (``api_key`` encoded) or the team's (None)."""
    return ALLOW_PREFIX + (api_key or "")


def check_pattern(pattern: str) -> str:
    """A model pattern as given, or ValueError naming what is wrong with it."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError("a model pattern must be a non-empty string")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(f"a model pattern is at most {MAX_PATTERN_LENGTH} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in pattern):
        raise ValueError(f"model pattern {pattern[:40]!r} holds a control character")
    return pattern


def encode(patterns: Iterable[str]) -> str:
    """A list as the policy hash holds it (patterns hold no control characters)."""
    return "\n".join(patterns)


@lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern[bytes]:
    parts = []
    for ch in pattern.encode():
        if ch == 0x2A:  # *
            parts.append(b".*")
        elif ch == 0x3F:  # ?
            parts.append(b".")
        else:
            parts.append(re.escape(bytes([ch])))
    return re.compile(b"".join(parts), re.DOTALL)


def allows(encoded: str, model: str) -> bool:
    """Whether a cached list admits ``model`` (the Lua script's rule, in Python)."""
    name = model.encode()
    return any(_regex(p).fullmatch(name) for p in encoded.split("\n") if p)
