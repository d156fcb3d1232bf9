"""Counting a stream's text deltas without parsing each one, exactly as parsing would.

The delta events of one stream repeat the same bytes around their text: an OpenAI chunk
carries the same id, model and ``"usage":null`` every time, an Anthropic
``content_block_delta`` the same index and delta type. Once one such event has been parsed,
:func:`learn` keeps the bytes before and after its text as a :class:`DeltaShape`; a later event
with exactly those bytes around a plain string is counted by :meth:`DeltaShape.chars`, no JSON
parse, and anything else is parsed as before.

Why this is exact: the learned event has no backslash, so every quote in it delimits a string
and its text's bytes appear as that string, and only once, or no shape is learned. Putting any
other text free of quotes, backslashes and control characters between the same bytes yields a
document that parses to the same object with only that string changed; the event then adds the
same characters besides its text, and changes nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

# What a JSON string may not hold unescaped: where a text has one, the event is parsed.
_NOT_PLAIN: Final = re.compile(rb'["\\\x00-\x1f]')


@dataclass(frozen=True, slots=True)
class DeltaShape:
    """The bytes around the text of one stream's delta events."""

    name: str  # the SSE ``event:`` name they come with
    head: bytes  # up to and including the text's opening quote
    tail: bytes  # from the text's closing quote to the end
    extra: int  # characters such an event adds besides its text
    model: str | None  # the stream's model once one was applied (a shape holds only then)

    def chars(self, payload: bytes) -> int | None:
        """Characters of generated text ``payload`` adds, or None if it isn't of this shape
        (it must be parsed)."""
        head, tail = self.head, self.tail
        end = len(payload) - len(tail)
        if end < len(head) or not payload.startswith(head) or not payload.endswith(tail):
            return None
        text = payload[len(head) : end]
        if _NOT_PLAIN.search(text) is not None:
            return None
        if text.isascii():
            return self.extra + len(text)
        try:
            return self.extra + len(text.decode("utf-8"))
        except UnicodeDecodeError:
            return None  # parsing refuses it too, and counts nothing


def learn(payload: bytes, name: str, text: str, added: int, model: str | None) -> DeltaShape | None:
    """The shape of a parsed event whose only effect was adding ``added`` characters, ``text``
    among them; None when its text can't be located with certainty."""
    if not text or b"\\" in payload:
        return None
    try:
        token = b'"' + text.encode("utf-8") + b'"'
    except UnicodeEncodeError:
        return None
    at = payload.find(token)
    if at < 0 or payload.find(token, at + 1) >= 0:
        return None  # absent as such, or not only where the text is
    return DeltaShape(
        name, payload[: at + 1], payload[at + len(token) - 1 :], added - len(text), model
    )
