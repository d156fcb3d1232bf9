"""``POST /v1/messages``: an Anthropic ``message``, or ``message_start`` ... ``message_stop``."""

from __future__ import annotations

from typing import Any

from ..framing import JSON, SSE, anthropic_headers, anthropic_json, compact, event_frame
from .plan import Plan, Script, json_script


def messages_script(plan: Plan) -> Script:
    headers = anthropic_headers(plan.request_id)
    stop_reason = "max_tokens" if plan.truncated else "end_turn"
    cache_counts = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    full_usage = {
        "input_tokens": plan.usage.input_tokens,
        **cache_counts,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": plan.usage.output_tokens,
        "service_tier": "standard",
    }

    def message(content: list[dict[str, Any]], stop: str | None, usage: dict[str, Any]) -> Any:
        msg: dict[str, Any] = {
            "model": plan.model,
            "id": plan.response_id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
        }
        if plan.report_usage:
            msg["usage"] = usage
        return msg

    if not plan.stream:
        body = message([{"type": "text", "text": plan.text}], stop_reason, full_usage)
        return json_script(anthropic_json(body), JSON, headers)

    def event(payload: dict[str, Any]) -> bytes:
        return event_frame(payload["type"], compact(payload))

    # message_start reports the input side and a provisional output count (real streams say 1);
    # the final output count only arrives in message_delta.
    start_usage = {**full_usage, "output_tokens": min(1, plan.usage.output_tokens)}
    delta: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
    }
    if plan.report_usage:
        delta["usage"] = {
            "input_tokens": plan.usage.input_tokens,
            **cache_counts,
            "output_tokens": plan.usage.output_tokens,
        }
    prelude = (
        event({"type": "message_start", "message": message([], None, start_usage)}),
        event(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }
        ),
        # The real ping payload has a space after the colon, unlike every other event.
        event_frame("ping", '{"type": "ping"}'),
    )
    deltas = tuple(
        event(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": word},
            }
        )
        for word in plan.words
    )
    epilogue = (
        event({"type": "content_block_stop", "index": 0}),
        event(delta),
        event({"type": "message_stop"}),
    )
    return Script(SSE, headers, prelude, deltas, epilogue, streaming=True)
