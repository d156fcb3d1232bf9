"""Bodies larger than the buffer: keep a bounded head and tail, and recover ``usage`` and
``model`` from those fragments without parsing the whole body.

Real OpenAI/Anthropic bodies put ``usage`` near their end and ``model`` near their start, so a
body (or SSE event) too large to buffer whole still yields the provider's own numbers.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from .types import valid_model

# Past ``max_buffer`` only this much of a JSON body (or of an over-long SSE event) is kept.
# Real OpenAI/Anthropic bodies put ``usage`` within the last kilobyte or so; 256 KiB leaves a
# wide margin for trailing fields (Responses ``metadata``, ``user``...).
TAIL_BYTES: Final = 256 * 1024
# The first bytes of a JSON body are kept even after overflow, to recover ``model``.
HEAD_BYTES: Final = 4096
# A usage object is tiny; don't brace-match further than this from its opening brace.
_USAGE_SCAN_BYTES: Final = 64 * 1024

_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
_MODEL_KEY = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_STRUCTURAL = re.compile(rb'[{}"]')
# Rest of a JSON string after its opening quote (the "unrolled loop" form: linear, no
# catastrophic backtracking).
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class TailBuffer:
    """Bytes accumulated up to ``limit``; past that, the first ``head`` bytes and a tail only.

    After overflow the tail is trimmed lazily (when it reaches twice its size), so each byte is
    copied O(1) times and the buffer never exceeds ``limit`` + ``head``.
    """

    __slots__ = ("_buf", "_head", "_head_size", "_limit", "_tail", "overflowed")

    def __init__(self, limit: int, head: int) -> None:
        self._limit = limit
        self._tail = min(TAIL_BYTES, limit // 2)
        self._head_size = head
        self._buf = bytearray()
        self._head = bytearray()
        self.overflowed = False

    @property
    def size(self) -> int:
        return len(self._buf) + len(self._head)

    @property
    def head(self) -> bytes:
        return bytes(self._head)

    @property
    def data(self) -> bytearray:
        """Everything (not overflowed) or the kept tail (overflowed). Not a copy."""
        return self._buf

    @property
    def empty(self) -> bool:
        return not self._buf and not self.overflowed

    def append(self, data: bytes) -> None:
        if not data:
            return
        if len(self._head) < self._head_size:
            self._head += data[: self._head_size - len(self._head)]
        if not self.overflowed:
            if len(self._buf) + len(data) <= self._limit:
                self._buf += data
                return
            self.overflowed = True
        if len(data) >= self._tail:
            self._buf = bytearray(data[-self._tail :])
        else:
            self._buf += data
            if len(self._buf) > 2 * self._tail:
                del self._buf[: len(self._buf) - self._tail]

    def clear(self) -> None:
        self._buf = bytearray()
        self._head = bytearray()
        self.overflowed = False


def recover_usage(buf: bytes | bytearray) -> dict[str, Any] | None:
    """The last complete ``"usage": {...}`` object in a body fragment.

    A literal ``"usage"`` followed by ``:`` can only be an object key: inside a JSON string the
    quotes would be escaped. Usage is the last top-level field group in real bodies, so the last
    occurrence that brace-matches and parses is taken.
    """
    for match in reversed(list(_USAGE_KEY.finditer(buf))):
        start = match.end() - 1
        end = _match_brace(buf, start)
        if end is None:
            continue
        try:
            obj = json.loads(buf[start:end])
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def recover_model(*fragments: bytes | bytearray) -> str | None:
    """The first ``"model": "..."`` value in the fragments (tried in order), if a valid name."""
    for fragment in fragments:
        match = _MODEL_KEY.search(fragment)
        if match is not None:
            try:
                return valid_model(match.group(1).decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return None


def _match_brace(buf: bytes | bytearray, start: int) -> int | None:
    """End offset (exclusive) of the JSON object opening at ``buf[start]``, or None.

    Jumps between structural characters with regexes instead of a per-byte Python loop; strings
    are skipped whole so braces inside them don't count.
    """
    limit = min(len(buf), start + _USAGE_SCAN_BYTES)
    depth = 0
    pos = start
    while True:
        match = _STRUCTURAL.search(buf, pos, limit)
        if match is None:
            return None
        char = buf[match.start()]
        if char == 0x22:  # '"'
            string_end = _STRING_REST.match(buf, match.end(), limit)
            if string_end is None:
                return None
            pos = string_end.end()
            continue
        pos = match.end()
        depth += 1 if char == 0x7B else -1  # '{' or '}'
        if depth == 0:
            return pos
