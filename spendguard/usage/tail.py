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

# read_ends: a whole JSON object read from its two ends. JSON's whitespace, as json skips it.
# Possessive quantifiers: a JSON token matches one way only, so nothing is worth backtracking.
_WS: Final = rb"[ \t\n\r]*+"
_STRING: Final = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
# A value that holds no object or array: a string, a number, a literal (json's own NaN and
# Infinity included, as json.loads accepts them).
_SCALAR: Final = (
    rb"(?:" + _STRING + rb"|-?(?:0|[1-9]\d*+)(?:\.\d++)?(?:[eE][+-]?\d++)?"
    rb"|true|false|null|NaN|-?Infinity)"
)
# The body's opening brace, any keys with scalar values, then the model key and its string.
# Matching at the start proves the key is the top-level object's: nothing before it opened a
# nested value.
_HEAD_MODEL = re.compile(
    _WS
    + rb"\{(?:"
    + _WS
    + _STRING
    + _WS
    + rb":"
    + _WS
    + _SCALAR
    + _WS
    + rb",)*?"
    + _WS
    + rb'"model"'
    + _WS
    + rb":"
    + _WS
    + rb"("
    + _STRING
    + rb")"
)
_OPENS = re.compile(_WS + rb"\{")
_COLON = re.compile(_WS + rb":" + _WS)
_CLOSES = re.compile(r"[ \t\n\r]*\}[ \t\n\r]*\Z")
_COMMA = re.compile(r"[ \t\n\r]*,")
_KEY_STARTS = frozenset(b"{,")
_WS_BYTES = frozenset(b" \t\n\r")
_DECODER = json.JSONDecoder()


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


def read_ends(body: bytes) -> tuple[dict[str, Any], object] | None:
    """The top-level ``usage`` object and ``model`` value of a JSON object body, read from its
    ends without parsing what lies between (the generated text: most of the body, and the
    cost of parsing it grows with it); None when the body's ends don't show them
    unambiguously, and the caller parses it whole.

    ``usage`` is the last ``"usage"`` key, and is the top-level one only if what follows its
    value is ``}`` at the end of the body, or more key/value pairs (parsed) and then that
    ``}``: the object closing at the very end is the top-level one. ``model`` comes from those
    trailing pairs, or else from the head: the body's first keys, up to ``"model"``, must all
    have scalar values, so none opened a nested object. A body with no model key among those
    is parsed whole, like one whose usage isn't last. What is not read is not validated: a
    body broken in its middle but with well-formed ends yields its usage here where a whole
    parse would fail; and of duplicate top-level ``model`` keys (no provider sends them) the
    first in the head is taken where a whole parse takes the last.
    """
    pos = body.rfind(b'"usage"')
    if pos < 0 or _OPENS.match(body) is None:
        return None
    # A key starts after '{' or ',': this quote is not a string's closing one, nor escaped.
    before = pos - 1
    while before >= 0 and body[before] in _WS_BYTES:
        before -= 1
    if before < 0 or body[before] not in _KEY_STARTS:
        return None
    colon = _COLON.match(body, pos + 7)
    if colon is None:
        return None
    try:
        text = body[colon.end() :].decode("utf-8")
        usage, end = _DECODER.raw_decode(text)
        if not isinstance(usage, dict):
            return None
        trailing: dict[str, Any] = {}
        if _CLOSES.match(text, end) is None:
            comma = _COMMA.match(text, end)
            if comma is None:
                return None
            rest = "{" + text[comma.end() :]
            trailing, end = _DECODER.raw_decode(rest)
            if not isinstance(trailing, dict) or rest[end:].strip(" \t\n\r"):
                return None
    except (ValueError, RecursionError):  # includes UnicodeDecodeError
        return None
    if "usage" in trailing:  # a later usage key, spelt with escapes: it would win
        return None
    if "model" in trailing:
        return usage, trailing["model"]
    head = _HEAD_MODEL.match(body, 0, pos)
    if head is None:
        return None
    literal = head.group(1)
    try:
        model = json.loads(literal) if b"\\" in literal else literal[1:-1].decode("utf-8")
    except (ValueError, RecursionError):
        return None
    return usage, model


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
