"""Anthropic's response format: Messages, as JSON or SSE.

Anthropic's ``input_tokens`` already *excludes* cache reads and writes, which are reported
separately, so its counts map onto :class:`Usage` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .chars import anthropic_content_chars, str_len
from .types import InvalidCount, Usage, chars_to_tokens, token_count, valid_model

_COUNT_KEYS: Final = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


def normalise(usage: dict[str, Any]) -> Usage | None:
    """Messages usage; None if it has none of the counts or an implausible one (the charge
    is then estimated)."""
    if usage.keys().isdisjoint(_COUNT_KEYS):  # what any(... in usage) says, in C
        return None
    try:
        return Usage(
            input_tokens=token_count(usage.get("input_tokens")),
            output_tokens=token_count(usage.get("output_tokens")),
            cached_input_tokens=token_count(usage.get("cache_read_input_tokens")),
            cache_write_tokens=token_count(usage.get("cache_creation_input_tokens")),
        )
    except InvalidCount:
        return None


def output_chars(body: dict[str, Any]) -> int:
    """Generated characters in a whole JSON response (``content`` blocks)."""
    return anthropic_content_chars(body.get("content"))


@dataclass(slots=True)
class AnthropicStream:
    """What an Anthropic stream's events reported so far. Small and copyable."""

    started: bool = False  # saw message_start usage
    finished: bool = False  # saw message_delta usage (the final counts)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_chars: int = 0
    model: str | None = None
    untrusted: bool = False  # a usage event held an implausible count: estimate instead

    def apply(self, obj: dict[str, Any], kind: str) -> None:
        """Update from one event's parsed data; ``kind`` is its ``type`` (or ``event:`` name)."""
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                # text_delta / thinking_delta / input_json_delta (tool arguments): all billed.
                for key in ("text", "thinking", "partial_json"):
                    self.output_chars += str_len(delta.get(key))
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict):
                self.output_chars += str_len(block.get("text"))
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                self.model = valid_model(message.get("model")) or self.model
                usage = message.get("usage")
                if isinstance(usage, dict):
                    self._merge(usage, final=False)
        elif kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, dict):
                self._merge(usage, final=True)

    def delta_text(self, obj: dict[str, Any], kind: str) -> str | None:
        """A ``content_block_delta``'s text (or thinking, or tool input JSON): such an event
        changes nothing but the characters."""
        if kind != "content_block_delta":
            return None
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return None
        for key in ("text", "thinking", "partial_json"):
            text = delta.get(key)
            if isinstance(text, str):
                return text
        return None

    def apply_usage(self, usage: dict[str, Any]) -> None:
        """Take a usage object recovered from the tail of an over-long event: like the final
        counts of a message_delta."""
        self._merge(usage, final=True)

    def result(self) -> Usage | None:
        if self.untrusted:
            return None
        if self.finished:
            return Usage(
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                cached_input_tokens=self.cached_input_tokens,
                cache_write_tokens=self.cache_write_tokens,
            )
        if self.started:
            # The stream stopped before message_delta (client gone, upstream cut). Input and
            # cache counts from message_start are real and final; message_start's output count
            # is a placeholder (1), so output is estimated from the text actually streamed.
            return Usage(
                input_tokens=self.input_tokens,
                output_tokens=max(self.output_tokens, chars_to_tokens(self.output_chars)),
                cached_input_tokens=self.cached_input_tokens,
                cache_write_tokens=self.cache_write_tokens,
                estimated=True,
            )
        return None

    def _merge(self, usage: dict[str, Any], *, final: bool) -> None:
        """message_start (``final=False``) sets every count; message_delta (``final=True``) sets
        the final output and overrides input/cache counts only when it repeats them (newer
        streams do; older ones send only ``output_tokens``)."""
        present = [key for key in _COUNT_KEYS if usage.get(key) is not None]
        if not present:
            return
        try:
            for key in present:
                token_count(usage[key])
        except InvalidCount:
            self.untrusted = True
            return
        if final:
            self.finished = True
        else:
            self.started = True
        if not final or "input_tokens" in present:
            self.input_tokens = token_count(usage.get("input_tokens"))
        if not final or "output_tokens" in present:
            self.output_tokens = token_count(usage.get("output_tokens"))
        if not final or "cache_read_input_tokens" in present:
            self.cached_input_tokens = token_count(usage.get("cache_read_input_tokens"))
        if not final or "cache_creation_input_tokens" in present:
            self.cache_write_tokens = token_count(usage.get("cache_creation_input_tokens"))
