"""``POST /v1/chat/completions``: a ``chat.completion``, or ``chat.completion.chunk`` SSE.

A stream ends in ``data: [DONE]`` and carries a usage chunk only when the request sets
``stream_options.include_usage``.
"""

from __future__ import annotations

from typing import Any

from ...usage import Usage
from ..framing import DONE, JSON, SSE, data_frame, openai_headers, openai_json
from .plan import Plan, Script, json_script


def _chat_usage(usage: Usage) -> dict[str, Any]:
    """The ``usage`` object of a chat completion (no caching, audio or reasoning tokens)."""
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def chat_script(plan: Plan) -> Script:
    finish = "length" if plan.truncated else "stop"
    headers = openai_headers(plan.request_id)
    if not plan.stream:
        body: dict[str, Any] = {
            "id": plan.response_id,
            "object": "chat.completion",
            "created": plan.created,
            "model": plan.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": plan.text,
                        "refusal": None,
                        "annotations": [],
                    },
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
        }
        if plan.report_usage:
            body["usage"] = _chat_usage(plan.usage)
        body["service_tier"] = "default"
        body["system_fingerprint"] = "fp_fake"
        return json_script(openai_json(body), JSON, headers)

    with_usage = plan.include_usage_chunk

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        frame: dict[str, Any] = {
            "id": plan.response_id,
            "object": "chat.completion.chunk",
            "created": plan.created,
            "model": plan.model,
            "service_tier": "default",
            "system_fingerprint": "fp_fake",
            "choices": choices,
        }
        if with_usage:  # every chunk then has "usage": null except the last one
            frame["usage"] = usage
        return data_frame(frame)

    def choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    prelude = (chunk([choice({"role": "assistant", "content": "", "refusal": None})]),)
    deltas = tuple(chunk([choice({"content": word})]) for word in plan.words)
    epilogue = [chunk([choice({}, finish)])]
    if with_usage:
        epilogue.append(chunk([], _chat_usage(plan.usage)))
    epilogue.append(DONE)
    return Script(SSE, headers, prelude, deltas, tuple(epilogue), streaming=True)
