"""What an endpoint script reads (:class:`Plan`) and what it writes (:class:`Script`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...usage import Usage
from ..routes import Kind


@dataclass(frozen=True, slots=True)
class Plan:
    """One successful answer, decided before any byte is written."""

    kind: Kind
    body: Mapping[str, Any]
    model: str
    stream: bool
    words: tuple[str, ...]
    usage: Usage
    truncated: bool
    report_usage: bool
    request_id: str
    response_id: str
    created: int

    @property
    def text(self) -> str:
        return "".join(self.words)

    @property
    def include_usage_chunk(self) -> bool:
        # Like the real API: a streamed chat/completion carries usage only when asked for.
        options = self.body.get("stream_options")
        return (
            self.report_usage
            and isinstance(options, Mapping)
            and options.get("include_usage") is True
        )


@dataclass(frozen=True, slots=True)
class Script:
    """A 200 response split where the failure modes can cut it.

    ``deltas`` are the content chunks ``stall_after`` / ``stop_after`` count; ``prelude`` goes
    before them (role chunk, ``message_start``...) and ``epilogue`` after (finish, usage,
    ``[DONE]``), so a cut stream never carries the final usage.
    """

    media_type: str
    headers: Mapping[str, str]
    prelude: tuple[bytes, ...]
    deltas: tuple[bytes, ...]
    epilogue: tuple[bytes, ...]
    streaming: bool


def json_script(payload: bytes, media_type: str, headers: Mapping[str, str]) -> Script:
    """A whole (non-streaming) body, sent as one part."""
    return Script(media_type, headers, (), (), (payload,), streaming=False)
