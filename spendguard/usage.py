"""Token usage extraction from provider response bodies, fed chunk by chunk.

The middleware sees the response body as a sequence of ASGI ``http.response.body`` chunks and
must not delay or alter them. :class:`UsageObserver` watches those chunks on the side and, once
the body is over, reports the token usage the provider billed, normalised to one shape
(:class:`Usage`) for both dialects:

* ``openai``: Chat Completions, legacy Completions, Responses and Embeddings, as JSON or SSE.
  OpenAI's prompt/input counts *include* cached tokens, so cached tokens are subtracted.
* ``anthropic``: Messages, as JSON or SSE. Anthropic's ``input_tokens`` already *excludes*
  cache reads and writes, which are reported separately.

Design constraints, because this runs on every proxied request:

* ``feed`` never raises: a parsing problem must never break the client's response.
* Memory is bounded whatever the body size: JSON bodies are buffered up to ``max_buffer`` and
  only a bounded tail is kept past that; SSE keeps one partial line and one event at a time.
* Total work is O(body size): each byte is split into lines and parsed once; nothing re-scans
  the whole buffer per chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["Usage", "UsageObserver", "estimate_usage"]

Dialect = Literal["openai", "anthropic"]

# Any real request is at most a few million tokens (the largest context windows are ~2M), so a
# count above this cannot be genuine: it is corruption or a hostile upstream. Such a value is
# *ignored* (read as 0) like any other malformed field rather than clamped to the cap, because
# clamping would bill a tenant thousands of dollars for one call and lock them out on a bug.
_MAX_TOKENS: Final = 10**9

# Past ``max_buffer`` only this much of a JSON body (or of an over-long SSE event) is kept.
# Real OpenAI/Anthropic bodies put ``usage`` within the last kilobyte or so; 256 KiB leaves a
# wide margin for trailing fields (Responses ``metadata``, ``user``...).
_TAIL_BYTES: Final = 256 * 1024
# The first bytes of a JSON body are kept even after overflow, to recover ``model``.
_HEAD_BYTES: Final = 4096
# For an over-long SSE line only its first bytes are needed: they name the field (``data``...).
_LINE_HEAD_BYTES: Final = 16
# A usage object is tiny; don't brace-match further than this from its opening brace.
_USAGE_SCAN_BYTES: Final = 64 * 1024
# ``max_buffer`` is raised to at least this, so the tail can always hold a usage object.
_MIN_BUFFER: Final = 4096
_MAX_MODEL_LEN: Final = 256
_MAX_EVENT_NAME_LEN: Final = 128

_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
_MODEL_KEY = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_STRUCTURAL = re.compile(rb'[{}"]')
# Rest of a JSON string after its opening quote (the "unrolled loop" form: linear, no
# catastrophic backtracking).
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)

_OPENAI_COUNT_KEYS: Final = (
    "prompt_tokens",
    "input_tokens",
    "completion_tokens",
    "output_tokens",
    "total_tokens",
)
_ANTHROPIC_COUNT_KEYS: Final = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)
# Responses API stream events whose ``delta`` string is generated (billed) output.
_RESPONSES_TEXT_DELTAS: Final = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
    }
)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage of one request, normalised across providers."""

    input_tokens: int = 0
    """Prompt tokens billed at the normal input price: excludes cache reads and cache writes."""
    output_tokens: int = 0
    """Completion/output tokens, reasoning included."""
    cached_input_tokens: int = 0
    """Cache reads (OpenAI ``cached_tokens``, Anthropic ``cache_read_input_tokens``)."""
    cache_write_tokens: int = 0
    """Cache writes (Anthropic ``cache_creation_input_tokens``)."""
    estimated: bool = False
    """True when spendguard estimated the counts instead of the provider reporting them."""


def estimate_usage(input_tokens: int, output_chars: int) -> Usage:
    """Usage to charge when the provider reported none: about 4 characters per output token."""
    return Usage(
        input_tokens=max(0, input_tokens),
        output_tokens=_chars_to_tokens(output_chars),
        estimated=True,
    )


def _chars_to_tokens(chars: int) -> int:
    """ceil(chars / 4) in integer arithmetic (no float rounding on huge counts)."""
    return -(-max(0, chars) // 4)


# ---------------------------------------------------------------------------------------------
# Normalisation of usage objects


def _tok(value: object) -> int:
    """A token count from an untrusted field: anything not a plausible count reads as 0.

    ``bool`` is an ``int`` subclass, hence the exact type check. Floats (even ``12.0``) and
    numeric strings are rejected: neither provider sends them, so they signal a broken upstream.
    """
    if type(value) is not int or value < 0 or value > _MAX_TOKENS:
        return 0
    return value


def _first_present(usage: dict[str, Any], *keys: str) -> object:
    for key in keys:
        value = usage.get(key)
        if value is not None:
            return value
    return None


def _normalise_openai(usage: dict[str, Any]) -> Usage | None:
    """OpenAI Chat/Completions (``prompt_tokens``...) or Responses (``input_tokens``...)."""
    if not any(key in usage for key in _OPENAI_COUNT_KEYS):
        return None
    output = _tok(_first_present(usage, "completion_tokens", "output_tokens"))
    raw_prompt = _first_present(usage, "prompt_tokens", "input_tokens")
    if raw_prompt is None:
        # Only a total (some OpenAI-compatible servers): whatever is not output is prompt.
        prompt = max(0, _tok(usage.get("total_tokens")) - output)
    else:
        prompt = _tok(raw_prompt)
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage.get("input_tokens_details")
    cached = _tok(details.get("cached_tokens")) if isinstance(details, dict) else 0
    # OpenAI's prompt count includes cached tokens. A cached count above the prompt is
    # inconsistent; cap it so input_tokens never goes negative and the total is preserved.
    cached = min(cached, prompt)
    return Usage(input_tokens=prompt - cached, output_tokens=output, cached_input_tokens=cached)


def _normalise_anthropic(usage: dict[str, Any]) -> Usage | None:
    """Anthropic: ``input_tokens`` already excludes cache reads and writes."""
    if not any(key in usage for key in _ANTHROPIC_COUNT_KEYS):
        return None
    return Usage(
        input_tokens=_tok(usage.get("input_tokens")),
        output_tokens=_tok(usage.get("output_tokens")),
        cached_input_tokens=_tok(usage.get("cache_read_input_tokens")),
        cache_write_tokens=_tok(usage.get("cache_creation_input_tokens")),
    )


def _normalise(dialect: Dialect, usage: dict[str, Any]) -> Usage | None:
    if dialect == "anthropic":
        return _normalise_anthropic(usage)
    return _normalise_openai(usage)


# ---------------------------------------------------------------------------------------------
# Generated-text counting (for estimation when usage is missing)


def _str_len(value: object) -> int:
    return len(value) if isinstance(value, str) else 0


def _content_chars(content: object) -> int:
    """Chat ``content``: a string or a list of parts with ``text``."""
    if isinstance(content, str):
        return len(content)
    total = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                total += _str_len(part.get("text"))
    return total


def _message_chars(message: object) -> int:
    """Chat ``message`` or stream ``delta``: text, refusal, reasoning and tool-call arguments
    are all generated (billed) output."""
    if not isinstance(message, dict):
        return 0
    total = _content_chars(message.get("content"))
    total += _str_len(message.get("refusal")) + _str_len(message.get("reasoning_content"))
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, dict):
                total += _function_chars(call.get("function"))
    return total + _function_chars(message.get("function_call"))


def _function_chars(function: object) -> int:
    return _str_len(function.get("arguments")) if isinstance(function, dict) else 0


def _choices_chars(choices: object, key: str) -> int:
    """``choices[]``: chat ``message``/``delta`` under ``key``, or legacy completions ``text``."""
    total = 0
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                total += _str_len(choice.get("text")) + _message_chars(choice.get(key))
    return total


def _responses_output_chars(output: object) -> int:
    """Responses API ``output[]`` items."""
    total = 0
    if not isinstance(output, list):
        return 0
    for item in output:
        if not isinstance(item, dict):
            continue
        total += _str_len(item.get("arguments"))  # function_call items
        for key in ("content", "summary"):  # message content parts / reasoning summaries
            parts = item.get(key)
            if isinstance(parts, list):
                for part in parts:
                    if isinstance(part, dict):
                        total += _str_len(part.get("text")) + _str_len(part.get("refusal"))
    return total


def _anthropic_content_chars(content: object) -> int:
    total = 0
    if not isinstance(content, list):
        return 0
    for block in content:
        if not isinstance(block, dict):
            continue
        total += _str_len(block.get("text")) + _str_len(block.get("thinking"))
        tool_input = block.get("input")
        if isinstance(tool_input, dict) and tool_input:
            # Tool arguments are generated as JSON text; their serialised size approximates it.
            with contextlib.suppress(TypeError, ValueError, RecursionError):
                total += len(json.dumps(tool_input))
    return total


def _valid_model(value: object) -> str | None:
    # Same rules as a request's model: it may be used for pricing and lands in ledger rows.
    if (
        isinstance(value, str)
        and 0 < len(value) <= _MAX_MODEL_LEN
        and value.strip()
        and value.isprintable()
    ):
        return value
    return None


# ---------------------------------------------------------------------------------------------
# Tail recovery for bodies/events larger than the buffer


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


def _recover_usage(buf: bytes | bytearray) -> dict[str, Any] | None:
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


def _recover_model(*fragments: bytes | bytearray) -> str | None:
    for fragment in fragments:
        match = _MODEL_KEY.search(fragment)
        if match is not None:
            try:
                return _valid_model(match.group(1).decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return None


class _TailBuffer:
    """Bytes accumulated up to ``limit``; past that, the first ``head`` bytes and a tail only.

    After overflow the tail is trimmed lazily (when it reaches twice its size), so each byte is
    copied O(1) times and the buffer never exceeds ``limit`` + ``head``.
    """

    __slots__ = ("_buf", "_head", "_head_size", "_limit", "_tail", "overflowed")

    def __init__(self, limit: int, head: int) -> None:
        self._limit = limit
        self._tail = min(_TAIL_BYTES, limit // 2)
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


# ---------------------------------------------------------------------------------------------
# SSE event handling


@dataclass(slots=True)
class _StreamState:
    """What the SSE events reported so far. Small and copyable (see ``_snapshot``)."""

    usage: Usage | None = None  # openai: the last non-null usage
    anthropic_start: bool = False  # saw message_start usage
    anthropic_delta: bool = False  # saw message_delta usage (the final counts)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_chars: int = 0
    model: str | None = None

    def set_model(self, value: object) -> None:
        model = _valid_model(value)
        if model is not None:
            self.model = model

    def result(self, dialect: Dialect) -> Usage | None:
        if dialect == "openai":
            return self.usage
        if self.anthropic_delta:
            return Usage(
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                cached_input_tokens=self.cached_input_tokens,
                cache_write_tokens=self.cache_write_tokens,
            )
        if self.anthropic_start:
            # The stream stopped before message_delta (client gone, upstream cut). Input and
            # cache counts from message_start are real and final; message_start's output count
            # is a placeholder (1), so output is estimated from the text actually streamed.
            return Usage(
                input_tokens=self.input_tokens,
                output_tokens=max(self.output_tokens, _chars_to_tokens(self.output_chars)),
                cached_input_tokens=self.cached_input_tokens,
                cache_write_tokens=self.cache_write_tokens,
                estimated=True,
            )
        return None


def _apply_event(
    state: _StreamState, dialect: Dialect, payload: bytes, truncated: bool, event: str
) -> None:
    """Update ``state`` from one SSE event's data."""
    if truncated:
        # Only the tail of an event larger than max_buffer was kept (e.g. a Responses
        # ``response.completed`` echoing a huge output): usage sits at its end.
        recovered = _recover_usage(payload)
        if recovered is not None:
            _apply_usage_only(state, dialect, recovered)
        return
    payload = payload.strip()
    if not payload or payload == b"[DONE]":
        return
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):  # includes UnicodeDecodeError
        return
    if not isinstance(obj, dict):
        return
    kind = obj.get("type")
    if not isinstance(kind, str):
        kind = event  # fall back to the ``event:`` line
    if dialect == "anthropic":
        _apply_anthropic(state, obj, kind)
    else:
        _apply_openai(state, obj, kind)


def _apply_usage_only(state: _StreamState, dialect: Dialect, usage: dict[str, Any]) -> None:
    if dialect == "openai":
        normalised = _normalise_openai(usage)
        if normalised is not None:
            state.usage = normalised
    else:
        _merge_anthropic(state, usage, final=True)


def _apply_openai(state: _StreamState, obj: dict[str, Any], kind: str) -> None:
    if kind.startswith("response."):  # Responses API
        response = obj.get("response")
        if isinstance(response, dict):
            state.set_model(response.get("model"))
            # response.completed / .incomplete / .failed carry the usage; earlier events
            # (created, in_progress) carry ``usage: null``.
            usage = response.get("usage")
            if isinstance(usage, dict):
                normalised = _normalise_openai(usage)
                if normalised is not None:
                    state.usage = normalised
        if kind in _RESPONSES_TEXT_DELTAS:
            state.output_chars += _str_len(obj.get("delta"))
        return
    # Chat Completions / legacy Completions chunk. Usage is null on every chunk but the last
    # (and only present at all with stream_options.include_usage).
    state.set_model(obj.get("model"))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        normalised = _normalise_openai(usage)
        if normalised is not None:
            state.usage = normalised
    state.output_chars += _choices_chars(obj.get("choices"), "delta")


def _merge_anthropic(state: _StreamState, usage: dict[str, Any], *, final: bool) -> None:
    """message_start (``final=False``) sets every count; message_delta (``final=True``) sets
    the final output and overrides input/cache counts only when it repeats them (newer streams
    do; older ones send only ``output_tokens``)."""
    present = [key for key in _ANTHROPIC_COUNT_KEYS if usage.get(key) is not None]
    if not present:
        return
    if final:
        state.anthropic_delta = True
    else:
        state.anthropic_start = True
    if not final or "input_tokens" in present:
        state.input_tokens = _tok(usage.get("input_tokens"))
    if not final or "output_tokens" in present:
        state.output_tokens = _tok(usage.get("output_tokens"))
    if not final or "cache_read_input_tokens" in present:
        state.cached_input_tokens = _tok(usage.get("cache_read_input_tokens"))
    if not final or "cache_creation_input_tokens" in present:
        state.cache_write_tokens = _tok(usage.get("cache_creation_input_tokens"))


def _apply_anthropic(state: _StreamState, obj: dict[str, Any], kind: str) -> None:
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict):
            # text_delta / thinking_delta / input_json_delta (tool arguments): all billed output.
            for key in ("text", "thinking", "partial_json"):
                state.output_chars += _str_len(delta.get(key))
    elif kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict):
            state.output_chars += _str_len(block.get("text"))
    elif kind == "message_start":
        message = obj.get("message")
        if isinstance(message, dict):
            state.set_model(message.get("model"))
            usage = message.get("usage")
            if isinstance(usage, dict):
                _merge_anthropic(state, usage, final=False)
    elif kind == "message_delta":
        usage = obj.get("usage")
        if isinstance(usage, dict):
            _merge_anthropic(state, usage, final=True)


# ---------------------------------------------------------------------------------------------
# The observer


class UsageObserver:
    """Watches a response body chunk by chunk and extracts the usage the provider reported.

    ``feed`` every body chunk in order, then call :meth:`result`. Neither ever raises.
    """

    __slots__ = (
        "_body",
        "_data_lines",
        "_data_size",
        "_data_truncated",
        "_dialect",
        "_event",
        "_failed",
        "_first_line",
        "_json_cache",
        "_max_buffer",
        "_partial",
        "_skip_lf",
        "_sse",
        "_state",
    )

    def __init__(
        self,
        dialect: Literal["openai", "anthropic"],
        content_type: str | None,
        *,
        max_buffer: int = 8 * 1024 * 1024,
    ) -> None:
        self._dialect: Dialect = dialect
        self._max_buffer = max(max_buffer, _MIN_BUFFER)
        self._sse = (content_type or "").strip().lower().startswith("text/event-stream")
        self._failed = False
        # JSON mode
        self._body = _TailBuffer(self._max_buffer, _HEAD_BYTES)
        self._json_cache: tuple[Usage | None, int, str | None] | None = None
        # SSE mode: the unterminated last line, and the data lines of the current event.
        self._partial = _TailBuffer(self._max_buffer, _LINE_HEAD_BYTES)
        self._skip_lf = False  # last chunk ended in CR: a leading LF completes a CRLF
        self._first_line = True  # a UTF-8 BOM may precede it
        self._data_lines: list[bytes] = []
        self._data_size = 0
        self._data_truncated = False
        self._event = ""
        self._state = _StreamState()

    # -- public API ----------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        """Observe the next body chunk. Never raises, whatever the bytes."""
        if self._failed:
            return
        try:
            data = chunk if isinstance(chunk, bytes) else bytes(chunk)
            if not data:
                return
            if self._sse:
                self._feed_sse(data)
            else:
                self._json_cache = None
                self._body.append(data)
        except Exception:
            # A bug here must never break the proxied response; stop observing instead. The
            # caller then sees no (or partial SSE) usage and falls back to estimation.
            self._failed = True

    def result(self) -> Usage | None:
        """Usage the provider reported, or None if the body had none or was unparseable."""
        try:
            if self._sse:
                return self._snapshot().result(self._dialect)
            return self._json_result()[0]
        except Exception:
            return None

    @property
    def output_chars(self) -> int:
        """Characters of generated text seen so far, for estimation when usage is missing."""
        try:
            if self._sse:
                return self._snapshot().output_chars
            return self._json_result()[1]
        except Exception:
            return 0

    @property
    def model(self) -> str | None:
        """Model name the response reported, if any."""
        try:
            if self._sse:
                return self._snapshot().model
            return self._json_result()[2]
        except Exception:
            return None

    def _buffered_size(self) -> int:
        """Bytes currently held (for tests asserting that memory stays bounded)."""
        if self._sse:
            return self._partial.size + self._data_size
        return self._body.size

    # -- JSON ----------------------------------------------------------------------------------

    def _json_result(self) -> tuple[Usage | None, int, str | None]:
        if self._json_cache is None:
            self._json_cache = self._parse_json()
        return self._json_cache

    def _parse_json(self) -> tuple[Usage | None, int, str | None]:
        if self._failed:
            return None, 0, None
        body = self._body
        if body.overflowed:
            # Too big to parse whole (e.g. a large embeddings batch): only the tail is left.
            recovered = _recover_usage(body.data)
            usage = _normalise(self._dialect, recovered) if recovered is not None else None
            return usage, 0, _recover_model(body.head, body.data)
        try:
            obj = json.loads(body.data)
        except (ValueError, RecursionError):
            return None, 0, None
        if not isinstance(obj, dict):
            return None, 0, None
        raw_usage = obj.get("usage")
        usage = _normalise(self._dialect, raw_usage) if isinstance(raw_usage, dict) else None
        if self._dialect == "anthropic":
            chars = _anthropic_content_chars(obj.get("content"))
        else:
            chars = _choices_chars(obj.get("choices"), "message")
            chars += _responses_output_chars(obj.get("output"))
        return usage, chars, _valid_model(obj.get("model"))

    # -- SSE -----------------------------------------------------------------------------------

    def _feed_sse(self, data: bytes) -> None:
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
                if not data:
                    return
        if b"\r" in data:
            # SSE allows CRLF, LF and lone CR. A CR ending the chunk may be half of a CRLF whose
            # LF arrives next: it ends the line now, and that LF is skipped.
            self._skip_lf = data[-1:] == b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        if len(lines) == 1:
            self._partial.append(data)
            return
        if self._partial.empty:
            self._process_line(lines[0], False, b"")
        else:
            self._partial.append(lines[0])
            partial = self._partial
            self._process_line(bytes(partial.data), partial.overflowed, partial.head)
            partial.clear()
        for line in lines[1:-1]:
            self._process_line(line, False, b"")
        self._partial.append(lines[-1])

    def _process_line(self, line: bytes, truncated: bool, head: bytes) -> None:
        """One complete SSE line. ``truncated``: only the line's tail and ``head`` were kept."""
        if self._first_line:
            self._first_line = False
            if truncated:
                head = head.removeprefix(b"\xef\xbb\xbf")
            else:
                line = line.removeprefix(b"\xef\xbb\xbf")
        if not line and not truncated:
            self._dispatch()
            return
        field = _parse_field(line, truncated, head)
        if field is None:
            return
        name, value = field
        if name == b"data":
            self._append_data(value, truncated)
        elif name == b"event" and not truncated:
            self._event = value[:_MAX_EVENT_NAME_LEN].decode("utf-8", "replace")
        # ``id``, ``retry`` and unknown fields are irrelevant to usage.

    def _append_data(self, value: bytes, truncated: bool) -> None:
        size = self._data_size + len(value) + (1 if self._data_lines else 0)
        if not truncated and not self._data_truncated and size <= self._max_buffer:
            self._data_lines.append(value)
            self._data_size = size
            return
        # The event outgrew the buffer (or one of its lines did): keep only its tail, which is
        # where a usage object would be.
        joined = b"\n".join([*self._data_lines, value])
        tail = joined[-min(_TAIL_BYTES, self._max_buffer // 2) :]
        self._data_lines = [tail]
        self._data_size = len(tail)
        self._data_truncated = True

    def _dispatch(self) -> None:
        """End of an event (blank line): apply its data."""
        if self._data_lines:
            payload = (
                self._data_lines[0] if len(self._data_lines) == 1 else b"\n".join(self._data_lines)
            )
            _apply_event(self._state, self._dialect, payload, self._data_truncated, self._event)
        self._data_lines = []
        self._data_size = 0
        self._data_truncated = False
        self._event = ""

    def _snapshot(self) -> _StreamState:
        """State including an event the stream has not terminated yet (no final blank line),
        without consuming it: ``feed`` may still continue that event afterwards."""
        lines = self._data_lines
        truncated = self._data_truncated
        if not self._partial.empty:
            partial = self._partial
            head = partial.head
            line = bytes(partial.data)
            if self._first_line:
                head = head.removeprefix(b"\xef\xbb\xbf")
                line = line.removeprefix(b"\xef\xbb\xbf")
            field = _parse_field(line, partial.overflowed, head)
            if field is not None and field[0] == b"data":
                lines = [*lines, field[1]]
                truncated = truncated or partial.overflowed
        if not lines:
            return self._state
        state = dataclasses.replace(self._state)
        payload = b"\n".join(lines)
        if not truncated and len(payload) > self._max_buffer:
            payload, truncated = payload[-_TAIL_BYTES:], True
        _apply_event(state, self._dialect, payload, truncated, self._event)
        return state


def _parse_field(line: bytes, truncated: bool, head: bytes) -> tuple[bytes, bytes] | None:
    """``(field name, value)`` of an SSE line, or None for a comment.

    For a truncated line the name comes from its kept head and the value is the kept tail (the
    name and the start of the value were dropped).
    """
    source = head if truncated else line
    if source[:1] == b":":
        return None
    colon = source.find(b":")
    name = source if colon < 0 else source[:colon]
    if truncated:
        return name, line
    if colon < 0:
        return name, b""
    value = line[colon + 1 :]
    if value[:1] == b" ":
        value = value[1:]
    return name, value
