"""Watching a response body chunk by chunk and reporting the usage the provider billed.

The middleware sees the body as a sequence of ASGI ``http.response.body`` chunks and must not
delay or alter them. :class:`UsageObserver` watches those chunks on the side and, once the body
is over, reports the provider's token usage as a :class:`Usage`. It only routes bytes: SSE
bodies through :mod:`.sse`, JSON bodies into a bounded :mod:`.tail` buffer, and the parsed
events or body to the dialect's module (:mod:`.openai`, :mod:`.anthropic`).

Design constraints, because this runs on every proxied request:

* ``feed`` never raises: a parsing problem must never break the client's response.
* Memory is bounded whatever the body size: JSON bodies are buffered up to ``max_buffer`` and
  only a bounded tail is kept past that; SSE keeps one partial line and one event at a time.
* Total work is O(body size): each byte is split into lines and parsed once; nothing re-scans
  the whole buffer per chunk.
* A stream costs almost nothing while it passes: its chunks are only held (up to
  ``_HOLD_BYTES``, beyond which they are parsed as they come). Asked for usage, the observer
  reads the last held events first: a stream reports its usage and model last, and the last
  report wins, so when those events have them nothing before them can change the answer. Only
  otherwise (no usage in the last events, or their framing is unusual) is everything held
  parsed, exactly as it would have been chunk by chunk.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from . import anthropic, openai
from .shapes import DeltaShape, learn
from .sse import Event, SSEDecoder
from .tail import HEAD_BYTES, TailBuffer, read_ends, recover_model, recover_usage
from .types import Dialect, Usage, valid_model

# ``max_buffer`` is raised to at least this, so the tail can always hold a usage object.
_MIN_BUFFER: Final = 4096
# Stream chunks held unparsed, at most (bytes); beyond it they are parsed as they come.
_HOLD_BYTES: Final = 64 * 1024
# Data events read back from the end of the held bytes for usage and model before giving up
# and parsing everything held (a stream ends with its usage event and ``[DONE]``).
_TAIL_EVENTS: Final = 4
_BOM: Final = b"\xef\xbb\xbf"
# JSON bodies shorter than this are parsed whole: below about a kilobyte that costs no more
# than reading their ends (about 4.5 µs either way on the benchmarks' machine).
_ENDS_FROM: Final = 1024
# json.loads without its per-call checks: called for every response and SSE event.
_JSON: Final = json.JSONDecoder()


class _Stream(Protocol):
    """A dialect's record of what its stream events reported so far."""

    output_chars: int
    model: str | None

    def apply(self, obj: dict[str, Any], kind: str) -> None: ...
    def apply_usage(self, usage: dict[str, Any]) -> None: ...
    def result(self) -> Usage | None: ...

    def delta_text(self, obj: dict[str, Any], kind: str) -> str | None:
        """The generated text of an event whose only effect was adding characters (this text
        and, event after event, the same others), or None."""
        ...


@dataclass(frozen=True, slots=True)
class _Format:
    """What the observer needs from a dialect's module."""

    normalise: Callable[[dict[str, Any]], Usage | None]
    output_chars: Callable[[dict[str, Any]], int]
    stream: Callable[[], _Stream]
    # The raw usage and model one stream event carries, when the stream's usage and model are
    # simply the last ones reported (so they can be read from its end); else None.
    reported: Callable[[dict[str, Any], str], tuple[object, object]] | None


_FORMATS: Final[dict[str, _Format]] = {
    Dialect.OPENAI: _Format(
        openai.normalise, openai.output_chars, openai.OpenAIStream, openai.reported
    ),
    # Anthropic's usage is merged from message_start and message_delta: parsed in order.
    Dialect.ANTHROPIC: _Format(
        anthropic.normalise, anthropic.output_chars, anthropic.AnthropicStream, None
    ),
}


class UsageObserver:
    """Watches a response body chunk by chunk and extracts the usage the provider reported.

    ``feed`` every body chunk in order, then call :meth:`result`. Neither ever raises.
    """

    __slots__ = (
        "_body",
        "_failed",
        "_format",
        "_from_end_cache",
        "_held",
        "_held_size",
        "_hold",
        "_json_cache",
        "_shape",
        "_sse",
        "_stream",
    )

    def __init__(
        self,
        dialect: Dialect | Literal["openai", "anthropic"],
        content_type: str | None,
        *,
        max_buffer: int = 8 * 1024 * 1024,
    ) -> None:
        # A string naming no dialect reads as OpenAI's format rather than failing the response.
        self._format = _FORMATS.get(dialect, _FORMATS[Dialect.OPENAI])
        max_buffer = max(max_buffer, _MIN_BUFFER)
        self._failed = False
        self._held: list[bytes] = []  # stream chunks not parsed yet, in order
        self._held_size = 0
        # What _from_end found for the held chunks as they were (their count): usage and model
        # are asked for one after the other.
        self._from_end_cache: tuple[int, tuple[Usage, str | None] | None] = (0, None)
        self._sse: SSEDecoder | None = None
        if (content_type or "").strip().lower().startswith("text/event-stream"):
            self._sse = SSEDecoder(max_buffer)
        # A stream's chunks are held up to _HOLD_BYTES; a JSON body's up to max_buffer, past
        # which only its head and tail are kept (in _body).
        self._hold = min(_HOLD_BYTES, max_buffer) if self._sse is not None else max_buffer
        self._stream = self._format.stream()
        self._shape: DeltaShape | None = None  # of this stream's text deltas, once one was seen
        self._body: TailBuffer | None = None  # a JSON body that outgrew max_buffer
        # The parsed body's usage, the body itself (its text is counted only if asked for:
        # usually the provider reported usage) and its model.
        self._json_cache: tuple[Usage | None, dict[str, Any] | None, str | None] | None = None

    # -- public API ----------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        """Observe the next body chunk. Never raises, whatever the bytes."""
        if self._failed:
            return
        try:
            data = chunk if isinstance(chunk, bytes) else bytes(chunk)
            if not data:
                return
            if self._sse is None:
                self._json_cache = None
                if self._body is not None:
                    self._body.append(data)
                    return
            self._held.append(data)
            self._held_size += len(data)
            if self._held_size > self._hold:
                if self._sse is not None:
                    self._drain()
                else:
                    self._overflow()
        except Exception:
            # A bug here must never break the proxied response; stop observing instead. The
            # caller then sees no (or partial SSE) usage and falls back to estimation.
            self._failed = True

    def result(self) -> Usage | None:
        """Usage the provider reported, or None if the body had none or was unparseable."""
        try:
            if self._sse is not None:
                last = self._from_end()
                if last is not None:
                    return last[0]
                self._drain()
                return self._snapshot(self._sse).result()
            return self._json_result()[0]
        except Exception:
            return None

    @property
    def output_chars(self) -> int:
        """Characters of generated text seen so far, for estimation when usage is missing."""
        try:
            if self._sse is not None:
                self._drain()
                return self._snapshot(self._sse).output_chars
            obj = self._json_result()[1]
            if obj is None and self._body is None:  # usage was read from the body's ends
                obj = self._parse_json(self._json_data())[1]
            return self._format.output_chars(obj) if obj is not None else 0
        except Exception:
            return 0

    @property
    def model(self) -> str | None:
        """Model name the response reported, if any."""
        try:
            if self._sse is not None:
                last = self._from_end()
                if last is not None:
                    return last[1]
                self._drain()
                return self._snapshot(self._sse).model
            return self._json_result()[2]
        except Exception:
            return None

    def _buffered_size(self) -> int:
        """Bytes currently held (for tests asserting that memory stays bounded)."""
        if self._sse is not None:
            return self._sse.buffered + self._held_size
        return self._held_size + (self._body.size if self._body is not None else 0)

    # -- JSON ----------------------------------------------------------------------------------

    def _json_result(self) -> tuple[Usage | None, dict[str, Any] | None, str | None]:
        """Usage, the parsed body (None when it was not parsed whole) and model."""
        if self._json_cache is None:
            data = self._json_data()
            self._json_cache = self._read_json_ends(data) or self._parse_json(data)
        return self._json_cache

    def _json_data(self) -> bytes:
        held = self._held
        return held[0] if len(held) == 1 else b"".join(held)

    def _read_json_ends(self, data: bytes) -> tuple[Usage, None, str | None] | None:
        """Usage and model from the body's ends (tail.read_ends): parsing the text between
        them costs more the longer it is, and the provider's usage makes it unneeded. None
        when they can't be read so, or report no counts (the caller then estimates from the
        text, so the body is parsed whole)."""
        if self._failed or self._body is not None or len(data) < _ENDS_FROM:
            return None
        found = read_ends(data)
        if found is None:
            return None
        usage = self._format.normalise(found[0])
        if usage is None:
            return None
        return usage, None, valid_model(found[1])

    def _overflow(self) -> None:
        """The JSON body outgrew max_buffer (its hold): from now on only its head and tail are
        kept."""
        body = TailBuffer(self._hold, HEAD_BYTES)
        for chunk in self._held:
            body.append(chunk)
        self._held, self._held_size, self._body = [], 0, body

    def _parse_json(self, data: bytes) -> tuple[Usage | None, dict[str, Any] | None, str | None]:
        if self._failed:
            return None, None, None
        body = self._body
        normalise = self._format.normalise
        if body is not None:
            # Too big to parse whole (e.g. a large embeddings batch): only the tail is left.
            recovered = recover_usage(body.data)
            usage = normalise(recovered) if recovered is not None else None
            return usage, None, recover_model(body.head, body.data)
        try:
            # json.loads(bytes) first sniffs the encoding (BOMs, UTF-16/32): a body that opens
            # with "{" and no NUL after it is UTF-8 by that rule, so it is decoded as such.
            if data[:1] == b"{" and data[1:2] != b"\x00":
                obj = _JSON.decode(data.decode("utf-8", "surrogatepass"))
            else:
                obj = json.loads(data)
        except (ValueError, RecursionError):  # includes UnicodeDecodeError
            return None, None, None
        if not isinstance(obj, dict):
            return None, None, None
        raw_usage = obj.get("usage")
        usage = normalise(raw_usage) if isinstance(raw_usage, dict) else None
        return usage, obj, valid_model(obj.get("model"))

    # -- SSE -----------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Parse the held chunks, in order, into the stream's state."""
        held = self._held
        if not held:
            return
        self._held, self._held_size = [], 0
        self._from_end_cache = (0, None)
        if self._failed:
            return
        sse = self._sse
        assert sse is not None
        try:
            for chunk in held:
                for event in sse.decode(chunk):
                    self._apply(event)
        except Exception:
            self._failed = True  # as in feed: stop observing, keep what was seen

    def _from_end(self) -> tuple[Usage, str | None] | None:
        """Usage and model read from the last held events alone; None when that can't be done
        exactly, and the caller parses everything held instead.

        Exact because a stream's usage and model are the last ones it reports: events before
        one that reports both can't change them. It reads only events that are one ``data:``
        line each, with LF line ends, and nothing pending before the held bytes: any other
        framing takes the long way.
        """
        held = self._held
        cached_for, cached = self._from_end_cache
        if cached_for == len(held) and held:
            return cached
        found = self._read_end(held)
        self._from_end_cache = (len(held), found)
        return found

    def _read_end(self, held: list[bytes]) -> tuple[Usage, str | None] | None:
        reported, sse = self._format.reported, self._sse
        if reported is None or sse is None or not held or self._failed or not sse.idle:
            return None
        data = held[0] if len(held) == 1 else b"".join(held)
        if (
            b'"usage"' not in data  # nothing held reports usage
            or data[-2:] != b"\n\n"  # an event is still open
            or b"\r" in data
            or data.startswith(_BOM)
        ):
            return None
        normalise, max_event = self._format.normalise, sse.max_event
        usage: Usage | None = None
        model: str | None = None
        end, read = len(data), 0
        while end > 0:
            start = data.rfind(b"\n\n", 0, end)
            block = data[start + 2 if start >= 0 else 0 : end].strip(b"\n")
            end = start
            if b"\n" in block or len(block) > max_event:
                return None  # a multi-line or over-long event: parsed in order instead
            # A blank line, a comment or a field other than data alone dispatches no event.
            if block[:5] != b"data:":
                continue
            read += 1
            if read > _TAIL_EVENTS:
                return None
            value = block[5:]
            parsed = _parse(value[1:] if value[:1] == b" " else value, "")
            if parsed is None:
                continue
            raw_usage, raw_model = reported(*parsed)
            if model is None:
                model = valid_model(raw_model)
            if usage is None and isinstance(raw_usage, dict):
                usage = normalise(raw_usage)
            if usage is not None and model is not None:
                return usage, model
        if usage is None:
            return None
        # Every held event was read and none named a valid model: the one parsed before, if any.
        return usage, self._stream.model

    def _apply(self, event: Event) -> None:
        """Update the stream from one event: counted from its bytes when it has the shape of
        the last text delta, else parsed (and its shape learned, if it is a text delta)."""
        stream = self._stream
        data, truncated, name = event
        shape = self._shape
        if (
            shape is not None
            and not truncated
            and name == shape.name
            and stream.model == shape.model
            and (chars := shape.chars(data)) is not None
        ):
            stream.output_chars += chars
            return
        if truncated:
            _apply_event(stream, event)
            return
        parsed = _parse(data, name)
        if parsed is None:
            return
        obj, kind = parsed
        before = stream.output_chars
        stream.apply(obj, kind)
        text = stream.delta_text(obj, kind)
        if text:
            added = stream.output_chars - before
            learned = learn(data.strip(), name, text, added, stream.model)
            if learned is not None:
                self._shape = learned

    def _snapshot(self, sse: SSEDecoder) -> _Stream:
        """Stream state including an event the stream has not terminated yet (no final blank
        line), without consuming it: ``feed`` may still continue that event afterwards."""
        event = sse.pending()
        if event is None:
            return self._stream
        stream = copy.copy(self._stream)
        _apply_event(stream, event)
        return stream


def _apply_event(stream: _Stream, event: Event) -> None:
    """Update ``stream`` from one SSE event's data."""
    data, truncated, name = event
    if truncated:
        # Only the tail of an event larger than max_buffer was kept (e.g. a Responses
        # ``response.completed`` echoing a huge output): usage sits at its end.
        recovered = recover_usage(data)
        if recovered is not None:
            stream.apply_usage(recovered)
        return
    parsed = _parse(data, name)
    if parsed is not None:
        stream.apply(*parsed)


def _parse(data: bytes, name: str) -> tuple[dict[str, Any], str] | None:
    """An event's data as a JSON object and its kind (its ``type``, else its ``event:`` name),
    or None when it holds no object."""
    payload = data.strip()
    if not payload or payload == b"[DONE]":
        return None
    try:
        # SSE is UTF-8 by definition: decoding it here spares json the encoding detection.
        obj = _JSON.decode(payload.decode("utf-8"))
    except (ValueError, RecursionError):  # includes UnicodeDecodeError
        return None
    if not isinstance(obj, dict):
        return None
    kind = obj.get("type")
    return obj, kind if isinstance(kind, str) else name
