"""``POST /v1/completions``: a legacy ``text_completion``, JSON or SSE ending in ``[DONE]``."""

from __future__ import annotations

from typing import Any

from ..framing import DONE, JSON, SSE, data_frame, openai_headers, openai_json
from .plan import Plan, Script, json_script


def completions_script(plan: Plan) -> Script:
    finish = "length" if plan.truncated else "stop"
    headers = openai_headers(plan.request_id)
    usage = {
        "prompt_tokens": plan.usage.input_tokens,
        "completion_tokens": plan.usage.output_tokens,
        "total_tokens": plan.usage.input_tokens + plan.usage.output_tokens,
    }

    def completion(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": plan.response_id,
            "object": "text_completion",
            "created": plan.created,
            "model": plan.model,
            "choices": choices,
            "system_fingerprint": "fp_fake",
        }

    def choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    if not plan.stream:
        body = completion([choice(plan.text, finish)])
        if plan.report_usage:
            body["usage"] = usage
        return json_script(openai_json(body), JSON, headers)

    # Like chat: usage only when stream_options.include_usage asks for it.
    with_usage = plan.include_usage_chunk

    def chunk(choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> bytes:
        frame = completion(choices)
        if with_usage:
            frame["usage"] = usage_value
        return data_frame(frame)

    deltas = tuple(chunk([choice(word, None)]) for word in plan.words)
    epilogue = [chunk([choice("", finish)])]
    if with_usage:
        epilogue.append(chunk([], usage))
    epilogue.append(DONE)
    return Script(SSE, headers, (), deltas, tuple(epilogue), streaming=True)
