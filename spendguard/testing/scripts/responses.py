"""``POST /v1/responses``: a Responses API object, or its ``response.*`` SSE events."""

from __future__ import annotations

import itertools
from typing import Any

from ..framing import JSON, SSE, compact, event_frame, openai_headers, openai_json
from .plan import Plan, Script, json_script


def responses_script(plan: Plan) -> Script:
    headers = openai_headers(plan.request_id)
    item_id = plan.response_id.replace("resp_", "msg_", 1)
    final_status = "incomplete" if plan.truncated else "completed"
    usage = {
        "input_tokens": plan.usage.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": plan.usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": plan.usage.input_tokens + plan.usage.output_tokens,
    }
    text_part = {"type": "output_text", "annotations": [], "logprobs": [], "text": plan.text}

    def message_item(status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": item_id,
            "type": "message",
            "status": status,
            "content": content,
            "role": "assistant",
        }

    def response(status: str, output: list[dict[str, Any]], done: bool) -> dict[str, Any]:
        instructions = plan.body.get("instructions")
        max_output = plan.body.get("max_output_tokens")
        # Same fields, in the same order, as a recorded Responses object.
        return {
            "id": plan.response_id,
            "object": "response",
            "created_at": plan.created,
            "status": status,
            "background": False,
            "billing": {"payer": "developer"},
            "completed_at": plan.created if status == "completed" else None,
            "error": None,
            "frequency_penalty": 0.0,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": instructions if isinstance(instructions, str) else None,
            "max_output_tokens": max_output if isinstance(max_output, int) else None,
            "max_tool_calls": None,
            "model": plan.model,
            "output": output,
            "parallel_tool_calls": True,
            "presence_penalty": 0.0,
            "previous_response_id": None,
            "prompt_cache_key": None,
            "prompt_cache_retention": None,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": None,
            "service_tier": "default",
            "store": True,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": 0,
            "top_p": 1.0,
            "truncation": "disabled",
            # The schema always has the key: hidden or not-yet-known usage is null.
            "usage": usage if done and plan.report_usage else None,
            "user": None,
            "metadata": {},
        }

    final_output = [message_item(final_status, [text_part])]
    if not plan.stream:
        return json_script(
            openai_json(response(final_status, final_output, done=True)), JSON, headers
        )

    sequence = itertools.count()

    def event(name: str, **fields: Any) -> bytes:
        return event_frame(
            name, compact({"type": name, **fields, "sequence_number": next(sequence)})
        )

    in_progress = response("in_progress", [], done=False)
    prelude = (
        event("response.created", response=in_progress),
        event("response.in_progress", response=in_progress),
        event("response.output_item.added", item=message_item("in_progress", []), output_index=0),
        event(
            "response.content_part.added",
            content_index=0,
            item_id=item_id,
            output_index=0,
            part={**text_part, "text": ""},
        ),
    )
    deltas = tuple(
        event(
            "response.output_text.delta",
            content_index=0,
            delta=word,
            item_id=item_id,
            logprobs=[],
            output_index=0,
        )
        for word in plan.words
    )
    epilogue = (
        event(
            "response.output_text.done",
            content_index=0,
            item_id=item_id,
            logprobs=[],
            output_index=0,
            text=plan.text,
        ),
        event(
            "response.content_part.done",
            content_index=0,
            item_id=item_id,
            output_index=0,
            part=text_part,
        ),
        event("response.output_item.done", item=final_output[0], output_index=0),
        # A generation cut by max_output_tokens ends with response.incomplete, not .completed.
        event(f"response.{final_status}", response=response(final_status, final_output, True)),
    )
    return Script(SSE, headers, prelude, deltas, epilogue, streaming=True)
