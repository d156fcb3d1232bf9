"""Server-sent events: assembling the lines of a ``text/event-stream`` body into events.

Only what usage extraction needs is kept: the ``data`` of each event (its lines joined with
``\\n``) and its ``event`` name. ``id``, ``retry``, comments and unknown fields are dropped.
An event larger than ``max_event`` keeps only its tail, where a usage object would be, and is
flagged ``truncated``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, TypeAlias

from .lines import LineDecoder, LongLine
from .tail import TAIL_BYTES

# For an over-long line only its first bytes are needed: they name the field (``data``...).
_LINE_HEAD_BYTES: Final = 16
_MAX_EVENT_NAME_LEN: Final = 128


# One event: ``(data, truncated, event name)``. ``truncated``: only the tail of ``data`` was
# kept (the event outgrew the buffer). The name is the ``event:`` field, or ``""``. A plain
# tuple, not a NamedTuple: one is built per event on every stream, and this is cheaper.
Event: TypeAlias = tuple[bytes, bool, str]
_NO_EVENTS: Final[tuple[Event, ...]] = ()


class SSEDecoder:
    """Feed body chunks to :meth:`decode`; it returns the events they complete, in order."""

    __slots__ = ("_data_lines", "_data_size", "_data_truncated", "_event", "_lines", "_max_event")

    def __init__(self, max_event: int) -> None:
        self._max_event = max_event
        self._lines = LineDecoder(max_event, _LINE_HEAD_BYTES)
        # The current event: its data lines so far and its name.
        self._data_lines: list[bytes] = []
        self._data_size = 0
        self._data_truncated = False
        self._event = ""

    @property
    def buffered(self) -> int:
        """Bytes held for the current event and line (bounded by about ``2 * max_event``)."""
        return self._lines.buffered + self._data_size

    @property
    def max_event(self) -> int:
        return self._max_event

    @property
    def idle(self) -> bool:
        """Between events: no line, data or event name pending."""
        return not self._data_lines and not self._event and self._lines.idle

    def decode(self, chunk: bytes) -> Sequence[Event]:
        """The events ``chunk`` completes (their blank line arrived), in order."""
        whole = self._whole_event(chunk)
        if whole is not None:
            return whole
        lines = self._lines.decode(chunk)
        if not lines:
            return _NO_EVENTS
        events: list[Event] = []
        for line in lines:
            if isinstance(line, LongLine):
                field = _parse_long(line)
                if field is not None and field[0] == b"data":
                    self._append_data(field[1], True)
                # A long ``event`` name is dropped: no real event name is that long.
            elif not line:  # a blank line ends the event
                data_lines = self._data_lines
                if data_lines:
                    data = data_lines[0] if len(data_lines) == 1 else b"\n".join(data_lines)
                    events.append((data, self._data_truncated, self._event))
                self._data_lines = []
                self._data_size = 0
                self._data_truncated = False
                self._event = ""
            else:
                field = _parse_field(line)
                if field is None:
                    continue
                name, value = field
                if name == b"data":
                    self._append_data(value, False)
                elif name == b"event":
                    self._event = value[:_MAX_EVENT_NAME_LEN].decode("utf-8", "replace")
                # ``id``, ``retry`` and unknown fields are irrelevant to usage.
        return events

    def _whole_event(self, chunk: bytes) -> tuple[Event] | None:
        """The shape nearly every provider sends, decoded without splitting lines: a chunk
        that is exactly one ``data:`` line and its blank line, with nothing pending."""
        if (
            self._data_lines
            or self._event
            or chunk[:5] != b"data:"
            or chunk[-2:] != b"\n\n"
            or chunk.count(b"\n") != 2
            or len(chunk) > self._max_event
            or not self._lines.take_whole(chunk)
        ):
            return None
        value = chunk[5:-2]
        if value[:1] == b" ":
            value = value[1:]
        return ((value, False, ""),)

    def pending(self) -> Event | None:
        """The event the stream has not terminated yet (no blank line so far), including an
        unterminated ``data`` line, without consuming it: decoding may continue it after."""
        lines = self._data_lines
        truncated = self._data_truncated
        line = self._lines.pending()
        if isinstance(line, LongLine):
            field = _parse_long(line)
            if field is not None and field[0] == b"data":
                lines, truncated = [*lines, field[1]], True
        elif line is not None:
            field = _parse_field(line)
            if field is not None and field[0] == b"data":
                lines = [*lines, field[1]]
        if not lines:
            return None
        payload = b"\n".join(lines)
        if not truncated and len(payload) > self._max_event:
            payload, truncated = payload[-TAIL_BYTES:], True
        return payload, truncated, self._event

    def _append_data(self, value: bytes, truncated: bool) -> None:
        size = self._data_size + len(value) + (1 if self._data_lines else 0)
        if not truncated and not self._data_truncated and size <= self._max_event:
            self._data_lines.append(value)
            self._data_size = size
            return
        # The event outgrew the buffer (or one of its lines did): keep only its tail, which is
        # where a usage object would be.
        joined = b"\n".join([*self._data_lines, value])
        tail = joined[-min(TAIL_BYTES, self._max_event // 2) :]
        self._data_lines = [tail]
        self._data_size = len(tail)
        self._data_truncated = True


def _parse_field(line: bytes) -> tuple[bytes, bytes] | None:
    """``(field name, value)`` of an SSE line, or None for a comment."""
    if line[:1] == b":":
        return None
    colon = line.find(b":")
    if colon < 0:
        return line, b""
    value = line[colon + 1 :]
    if value[:1] == b" ":
        value = value[1:]
    return line[:colon], value


def _parse_long(line: LongLine) -> tuple[bytes, bytes] | None:
    """``(field name, value)`` of a line that outgrew the buffer, or None for a comment: the
    name comes from its kept head, and the value is its kept tail (the value's start was dropped
    with the middle of the line)."""
    head = line.head
    if head[:1] == b":":
        return None
    colon = head.find(b":")
    return (head if colon < 0 else head[:colon]), line.tail
