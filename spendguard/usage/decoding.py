"""Reading usage from compressed responses: the observer for a ``Content-Encoding``.

A gateway that relays the provider's bytes may pass gzip or deflate bodies through. They are
decompressed on the side, as they pass, with bounded output per chunk and in total, so usage
still comes from the provider's own numbers. An encoding that can't be decoded here (br, zstd)
is estimated generously from the body size: an unreadable response must not be nearly free.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Final, Protocol

from .observer import UsageObserver
from .types import Dialect, Usage

# Decoded bytes handed to the observer per step, and in total (a zip bomb stops decoding).
_STEP = 64 * 1024
_TOTAL = 256 * 1024 * 1024
# Text compresses by ~3-5x; counting 4 characters of output per compressed byte errs high.
_CHARS_PER_UNREADABLE_BYTE = 4


class BodyObserver(Protocol):
    """What the middleware feeds a response body to and reads usage from afterwards."""

    def feed(self, chunk: bytes) -> None: ...
    def result(self) -> Usage | None: ...
    @property
    def output_chars(self) -> int: ...
    @property
    def model(self) -> str | None: ...


class _Inflating:
    """gzip and zlib-wrapped deflate (auto-detected), decoded into a UsageObserver."""

    def __init__(self, inner: UsageObserver) -> None:
        self._inner = inner
        self._z: zlib._Decompress | None = zlib.decompressobj(wbits=47)
        self._decoded = 0
        self._raw = 0

    def feed(self, chunk: bytes) -> None:
        self._raw += len(chunk)
        if self._z is None:
            return
        try:
            data = chunk
            while data and self._decoded < _TOTAL:
                out = self._z.decompress(data, _STEP)
                self._decoded += len(out)
                self._inner.feed(out)
                data = self._z.unconsumed_tail
        except zlib.error:
            self._z = None  # not what it claimed to be: fall back to the size estimate

    def result(self) -> Usage | None:
        return self._inner.result() if self._z is not None else None

    @property
    def output_chars(self) -> int:
        if self._z is None:
            return max(self._inner.output_chars, self._raw * _CHARS_PER_UNREADABLE_BYTE)
        return self._inner.output_chars

    @property
    def model(self) -> str | None:
        return self._inner.model


class _Unreadable:
    """An encoding not decoded here: only the body size is counted."""

    def __init__(self) -> None:
        self._raw = 0

    def feed(self, chunk: bytes) -> None:
        self._raw += len(chunk)

    def result(self) -> Usage | None:
        return None

    @property
    def output_chars(self) -> int:
        return self._raw * _CHARS_PER_UNREADABLE_BYTE

    @property
    def model(self) -> str | None:
        return None


def _plain(dialect: Dialect, content_type: str | None) -> BodyObserver:
    return UsageObserver(dialect, content_type)


def _inflating(dialect: Dialect, content_type: str | None) -> BodyObserver:
    return _Inflating(UsageObserver(dialect, content_type))


def _unreadable(dialect: Dialect, content_type: str | None) -> BodyObserver:
    return _Unreadable()


# Content-Encoding (lower case) -> observer factory. Anything else is unreadable.
_DECODERS: Final[dict[str, Callable[[Dialect, str | None], BodyObserver]]] = {
    "": _plain,
    "identity": _plain,
    "gzip": _inflating,
    "x-gzip": _inflating,
    "deflate": _inflating,
}


def observer_for(dialect: str, content_type: str | None, encoding: str) -> BodyObserver:
    """The observer for a response body with this ``Content-Encoding``.

    ``dialect`` is a :class:`Dialect` or its value; anything but ``"anthropic"`` reads as
    OpenAI's format.
    """
    factory = _DECODERS.get(encoding.strip().lower(), _unreadable)
    return factory(
        Dialect.ANTHROPIC if dialect == Dialect.ANTHROPIC else Dialect.OPENAI, content_type
    )
