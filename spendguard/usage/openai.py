"""OpenAI's response format: Chat Completions, legacy Completions, Responses and Embeddings.

OpenAI's prompt/input counts *include* cached tokens, so cached tokens are subtracted to get
the tokens billed at the normal input price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .chars import choices_chars, responses_output_chars, str_len
from .types import InvalidCount, Usage, token_count, valid_model

_COUNT_KEYS: Final = (
    "prompt_tokens",
    "input_tokens",
    "completion_tokens",
    "output_tokens",
    "total_tokens",
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


def normalise(usage: dict[str, Any]) -> Usage | None:
    """Chat/Completions (``prompt_tokens``...) or Responses (``input_tokens``...) usage; None
    when it has no counts or an implausible one (the charge is then estimated)."""
    if usage.keys().isdisjoint(_COUNT_KEYS):  # what any(... in usage) says, in C
        return None
    try:
        return _counts(usage)
    except InvalidCount:
        return None


def _counts(usage: dict[str, Any]) -> Usage:
    output = token_count(_first_present(usage, "completion_tokens", "output_tokens"))
    raw_prompt = _first_present(usage, "prompt_tokens", "input_tokens")
    if raw_prompt is None:
        # Only a total (some OpenAI-compatible servers): whatever is not output is prompt.
        prompt = max(0, token_count(usage.get("total_tokens")) - output)
    else:
        prompt = token_count(raw_prompt)
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage.get("input_tokens_details")
    cached = token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    # OpenAI's prompt count includes cached tokens. A cached count above the prompt is
    # inconsistent; cap it so input_tokens never goes negative and the total is preserved.
    cached = min(cached, prompt)
    return Usage(input_tokens=prompt - cached, output_tokens=output, cached_input_tokens=cached)


def reported(obj: dict[str, Any], kind: str) -> tuple[object, object]:
    """The usage and model a stream event carries, unchecked, where :class:`OpenAIStream`
    reads them: a Responses event's ``response``, else the chunk itself."""
    if kind.startswith("response."):
        response = obj.get("response")
        if not isinstance(response, dict):
            return None, None
        return response.get("usage"), response.get("model")
    return obj.get("usage"), obj.get("model")


def output_chars(body: dict[str, Any]) -> int:
    """Generated characters in a whole JSON response (chat/completions ``choices`` or
    Responses ``output``)."""
    return choices_chars(body.get("choices"), "message") + responses_output_chars(
        body.get("output")
    )


@dataclass(slots=True)
class OpenAIStream:
    """What an OpenAI stream's events reported so far. Small and copyable."""

    usage: Usage | None = None  # the last non-null usage
    output_chars: int = 0
    model: str | None = None

    def apply(self, obj: dict[str, Any], kind: str) -> None:
        """Update from one event's parsed data; ``kind`` is its ``type`` (or ``event:`` name).

        Usage and model are read where :func:`reported` says (the observer reads a stream's
        end the same way): the last valid model and the last usage object win. Usage is null
        on every chat chunk but the last (and present at all only with
        stream_options.include_usage); Responses events carry it from response.completed,
        .incomplete or .failed.
        """
        usage, model = reported(obj, kind)
        if model != self.model:  # every chunk repeats it; validate it once
            self.model = valid_model(model) or self.model
        if isinstance(usage, dict):
            self.apply_usage(usage)
        if kind.startswith("response."):  # Responses API
            if kind in _RESPONSES_TEXT_DELTAS:
                self.output_chars += str_len(obj.get("delta"))
            return
        # Chat Completions / legacy Completions chunk.
        self.output_chars += choices_chars(obj.get("choices"), "delta")

    def delta_text(self, obj: dict[str, Any], kind: str) -> str | None:
        """A chat or completions chunk's first text, when the chunk carries no usage (the
        model it repeats changes nothing once applied). Responses events number themselves
        (``sequence_number``), so no two have the same bytes around their text: None."""
        if kind.startswith("response.") or isinstance(obj.get("usage"), dict):
            return None
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        return text if isinstance(text, str) else None

    def apply_usage(self, usage: dict[str, Any]) -> None:
        """Take a usage object (also one recovered from the tail of an over-long event)."""
        normalised = normalise(usage)
        if normalised is not None:
            self.usage = normalised

    def result(self) -> Usage | None:
        return self.usage


def _first_present(usage: dict[str, Any], *keys: str) -> object:
    for key in keys:
        value = usage.get(key)
        if value is not None:
            return value
    return None
