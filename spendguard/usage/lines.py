"""Splitting a byte stream into lines, whatever the chunk boundaries (like httpx's
``LineDecoder``, for bytes and with bounded memory).

Lines end in LF, CRLF or a lone CR, as SSE allows. A UTF-8 byte order mark before the first
line is dropped. A line longer than ``max_line`` is not buffered whole: only its first bytes
and a tail are kept, and it comes out as a :class:`LongLine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from .tail import TailBuffer

_BOM: Final = b"\xef\xbb\xbf"
# What a chunk completing no line decodes to; shared, as most chunks of a long line are such.
_NO_LINES: Final[tuple[bytes, ...]] = ()


class LongLine(NamedTuple):
    """A line that outgrew the buffer: its first bytes and its last bytes, the middle dropped."""

    head: bytes
    tail: bytes


class LineDecoder:
    """Feed chunks to :meth:`decode`; it returns the lines they complete, without terminators.

    A line longer than ``max_line`` keeps only its first ``keep_head`` bytes and a tail. Each
    byte is split and copied O(1) times, so decoding is linear in the stream size however small
    the chunks.
    """

    __slots__ = ("_at_start", "_partial", "_skip_lf")

    def __init__(self, max_line: int, keep_head: int) -> None:
        self._partial = TailBuffer(max_line, keep_head)  # the unterminated last line
        self._skip_lf = False  # last chunk ended in CR: a leading LF completes a CRLF
        self._at_start = True  # no line yet: a BOM may precede the first one

    @property
    def buffered(self) -> int:
        """Bytes held for the unterminated line."""
        return self._partial.size

    @property
    def idle(self) -> bool:
        """Between lines: nothing buffered and no CRLF half-seen, so the next byte starts a
        line (the stream's first line may still carry a BOM)."""
        return not self._skip_lf and self._partial.empty

    def take_whole(self, data: bytes) -> bool:
        """True (and the decoder's state moved past it) when ``data`` may bypass
        :meth:`decode`: nothing is pending and ``data`` ends in LF, without any CR, so its
        lines are exactly ``data.split(b"\n")`` with no line continued or left over."""
        if self._skip_lf or not self._partial.empty or b"\r" in data or data[-1:] != b"\n":
            return False
        if self._at_start:
            if data.startswith(_BOM):
                return False
            self._at_start = False
        return True

    def decode(self, data: bytes) -> Sequence[bytes | LongLine]:
        """The lines ``data`` completes, in order; an unterminated rest waits for more."""
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        if b"\r" in data:
            # A CR ending the chunk may be half of a CRLF whose LF arrives next: it ends the
            # line now, and that LF is skipped.
            self._skip_lf = data[-1:] == b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        partial = self._partial
        if len(lines) == 1:
            partial.append(data)
            return _NO_LINES
        first: bytes | LongLine = lines[0]
        if not partial.empty:
            partial.append(lines[0])
            kept = bytes(partial.data)
            first = LongLine(partial.head, kept) if partial.overflowed else kept
            partial.clear()
        if self._at_start:
            self._at_start = False
            first = _strip_bom(first)
        partial.append(lines[-1])
        out = [first]
        out += lines[1:-1]
        return out

    def pending(self) -> bytes | LongLine | None:
        """The unterminated last line so far, if any, without consuming it."""
        partial = self._partial
        if partial.empty:
            return None
        kept = bytes(partial.data)
        line: bytes | LongLine = LongLine(partial.head, kept) if partial.overflowed else kept
        return _strip_bom(line) if self._at_start else line


def _strip_bom(line: bytes | LongLine) -> bytes | LongLine:
    if isinstance(line, LongLine):
        return LongLine(line.head.removeprefix(_BOM), line.tail)
    return line.removeprefix(_BOM)
