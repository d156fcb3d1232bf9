"""A fake OpenAI/Anthropic-compatible upstream provider (ASGI app) for tests, demo, benchmarks.

It answers the five routes a spendguard gateway proxies, in the providers' real wire formats
(checked against recorded bodies and against the official ``openai`` and ``anthropic`` SDKs):

* ``POST /v1/chat/completions``: ``chat.completion``, or ``chat.completion.chunk`` SSE ending
  in ``data: [DONE]`` (usage chunk only with ``stream_options.include_usage``);
* ``POST /v1/completions``: legacy ``text_completion``, JSON or SSE ending in ``[DONE]``;
* ``POST /v1/responses``: a Responses API object, or ``response.*`` events;
* ``POST /v1/embeddings``: a ``list`` of embeddings, float or base64;
* ``POST /v1/messages``: an Anthropic ``message``, or ``message_start`` ... ``message_stop``.

Everything a test needs to predict is deterministic and computable from the request alone, so a
test can assert the exact micro-USD a gateway charged (:func:`expected_usage`):

* input tokens = ceil(units / 4), at least 1, where units counts the characters of every string
  in the prompt-bearing fields of the body (messages, prompt, input, instructions, system,
  tools...) plus 4 per integer (token-id arrays);
* the answer is ``chunks`` words ``"tok0 tok1 ..."``, one content delta per word, cut short at
  the request's own max-tokens field like a real model (then finish reason ``length`` /
  ``max_tokens`` / ``incomplete``); output tokens = ``output_tokens`` if given, else the number
  of words;
* no prompt caching: cached and cache-write counts are always 0.

Failure modes, per app or per request through ``x-fake-*`` headers (see :func:`fake_upstream`),
let tests drive the gateway's error paths: provider error envelopes, missing usage, streams that
stall forever and streams that are cut off mid-body.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import math
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import anyio
import httpx
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .usage import Usage

__all__ = [
    "ROUTES",
    "FakeUpstream",
    "ReceivedRequest",
    "StreamingASGITransport",
    "UpstreamAborted",
    "expected_text",
    "expected_usage",
    "fake_upstream",
]

Kind = Literal["chat", "completions", "responses", "embeddings", "messages"]

ROUTES: Final[Mapping[str, Kind]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
}
"""Path → endpoint kind of every route the fake answers (all ``POST``)."""

# Fields of the request body whose contents are "the prompt" and so count as input tokens.
_PROMPT_FIELDS: Final[Mapping[Kind, tuple[str, ...]]] = {
    "chat": ("messages", "tools", "functions"),
    "completions": ("prompt", "suffix"),
    "responses": ("instructions", "input", "tools"),
    "embeddings": ("input",),
    "messages": ("system", "messages", "tools"),
}
# Fields that cap the number of generated tokens, like the real APIs honour them.
_MAX_TOKEN_FIELDS: Final[Mapping[Kind, tuple[str, ...]]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "embeddings": (),
    "messages": ("max_tokens",),
}

_SSE: Final = "text/event-stream; charset=utf-8"
_JSON: Final = "application/json"
_DEFAULT_DIMENSIONS: Final = 8
_MAX_DIMENSIONS: Final = 4096
_RECEIVED_LIMIT: Final = 1000


class UpstreamAborted(RuntimeError):
    """Raised inside the fake on purpose (``stop_after``) so the server aborts the connection.

    Through ``httpx.ASGITransport`` it surfaces in the client as this exception; behind a real
    server (uvicorn) the client sees the connection close before the body ended.
    """


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    """One request as the fake received it, for asserting what the gateway forwarded."""

    path: str
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


# ---------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True, slots=True)
class _Options:
    report_usage: bool = True
    fail_status: int | None = None
    stall_after: int | None = None
    stop_after: int | None = None
    chunks: int = 5
    output_tokens: int | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        if self.fail_status is not None and not 400 <= self.fail_status <= 599:
            raise ValueError(
                f"fail_status must be an HTTP error status 400-599: {self.fail_status}"
            )
        for name in ("stall_after", "stop_after", "output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0: {value}")
        if self.chunks < 0:
            raise ValueError(f"chunks must be >= 0: {self.chunks}")
        if not math.isfinite(self.delay) or self.delay < 0:
            raise ValueError(f"delay must be a finite number of seconds >= 0: {self.delay}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0/true/false")


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_optional_int(text: str) -> int | None:
    # An empty value or "none" switches a failure mode off for one request.
    stripped = text.strip().lower()
    return None if stripped in ("", "none") else int(stripped)


def _parse_status(text: str) -> int | None:
    status = _parse_optional_int(text)
    return None if status == 0 else status


_HEADER_OPTIONS: Final[Mapping[str, tuple[str, Callable[[str], Any]]]] = {
    "x-fake-fail": ("fail_status", _parse_status),
    "x-fake-usage": ("report_usage", _parse_bool),
    "x-fake-stall-after": ("stall_after", _parse_optional_int),
    "x-fake-stop-after": ("stop_after", _parse_optional_int),
    "x-fake-chunks": ("chunks", _parse_int),
    "x-fake-output-tokens": ("output_tokens", _parse_optional_int),
    "x-fake-delay": ("delay", float),
}


def _options_for(defaults: _Options, headers: Headers) -> _Options:
    changes: dict[str, Any] = {}
    for header, (field, parse) in _HEADER_OPTIONS.items():
        raw = headers.get(header)
        if raw is None:
            continue
        try:
            changes[field] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"invalid {header} header {raw!r}: {exc}") from exc
    if not changes:
        return defaults
    try:
        return dataclasses.replace(defaults, **changes)
    except ValueError as exc:
        raise ValueError(f"invalid x-fake-* header: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Deterministic token arithmetic (shared by the app and expected_usage)


def _kind_for_path(path: str) -> Kind:
    # Accept prefixes (/anthropic/v1/messages), query strings and a trailing slash, so a test can
    # pass the path its gateway exposes rather than the upstream one.
    bare = path.split("?", 1)[0].rstrip("/")
    for route, kind in ROUTES.items():
        if bare.endswith(route):
            return kind
    raise ValueError(f"not a fake-upstream route: {path!r} (known: {', '.join(ROUTES)})")


def _text_units(value: object) -> int:
    """Characters of every string inside ``value`` plus 4 per integer (a token id)."""
    units = 0
    stack: list[object] = [value]
    while stack:  # iterative: a deeply nested body must not hit the recursion limit
        item = stack.pop()
        if isinstance(item, str):
            units += len(item)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            units += 4
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return units


def _input_tokens(kind: Kind, body: Mapping[str, Any]) -> int:
    units = sum(_text_units(body.get(field)) for field in _PROMPT_FIELDS[kind])
    return max(1, -(-units // 4))


def _word_count(kind: Kind, body: Mapping[str, Any], chunks: int) -> int:
    words = chunks
    for field in _MAX_TOKEN_FIELDS[kind]:
        cap = body.get(field)
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
            words = min(words, cap)
    return words


def _words(count: int) -> list[str]:
    return [f"tok{i}" if i == 0 else f" tok{i}" for i in range(count)]


def expected_usage(
    path: str, body: Mapping[str, Any], *, chunks: int = 5, output_tokens: int | None = None
) -> Usage:
    """The usage the fake reports for ``body`` POSTed to ``path``, normalised like spendguard.

    ``chunks`` and ``output_tokens`` must match the app's options (or the request's
    ``x-fake-chunks`` / ``x-fake-output-tokens`` headers). The result is what the provider
    *would* bill even when the fake is told to hide usage (``report_usage=False``).
    """
    kind = _kind_for_path(path)
    inp = _input_tokens(kind, body)
    if kind == "embeddings":
        return Usage(input_tokens=inp)
    words = _word_count(kind, body, chunks)
    return Usage(input_tokens=inp, output_tokens=words if output_tokens is None else output_tokens)


def expected_text(path: str, body: Mapping[str, Any], *, chunks: int = 5) -> str:
    """The generated text the fake answers with (empty for embeddings)."""
    kind = _kind_for_path(path)
    return "" if kind == "embeddings" else "".join(_words(_word_count(kind, body, chunks)))


# ---------------------------------------------------------------------------------------------
# Wire encoding


def _compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _openai_json(obj: object) -> bytes:
    # OpenAI pretty-prints JSON bodies with two spaces and a trailing newline.
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _anthropic_json(obj: object) -> bytes:
    # Anthropic sends compact single-line JSON without a trailing newline.
    return _compact(obj).encode()


def _data(obj: object) -> bytes:
    """Chat/Completions SSE frame: ``data:`` lines only, no ``event:``."""
    return f"data: {_compact(obj)}\n\n".encode()


def _event(name: str, payload: str) -> bytes:
    """Responses/Anthropic SSE frame: an ``event:`` line names every ``data:`` line."""
    return f"event: {name}\ndata: {payload}\n\n".encode()


_DONE: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class _Script:
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


@dataclass(frozen=True, slots=True)
class _Plan:
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


def _openai_headers(plan: _Plan) -> dict[str, str]:
    return {"x-request-id": plan.request_id}


def _json_script(payload: bytes, media_type: str, headers: Mapping[str, str]) -> _Script:
    return _Script(media_type, headers, (), (), (payload,), streaming=False)


def _chat_usage(usage: Usage) -> dict[str, Any]:
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


def _chat_script(plan: _Plan) -> _Script:
    finish = "length" if plan.truncated else "stop"
    headers = _openai_headers(plan)
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
        return _json_script(_openai_json(body), _JSON, headers)

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
        return _data(frame)

    def choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    prelude = (chunk([choice({"role": "assistant", "content": "", "refusal": None})]),)
    deltas = tuple(chunk([choice({"content": word})]) for word in plan.words)
    epilogue = [chunk([choice({}, finish)])]
    if with_usage:
        epilogue.append(chunk([], _chat_usage(plan.usage)))
    epilogue.append(_DONE)
    return _Script(_SSE, headers, prelude, deltas, tuple(epilogue), streaming=True)


def _completions_script(plan: _Plan) -> _Script:
    finish = "length" if plan.truncated else "stop"
    headers = _openai_headers(plan)
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
        return _json_script(_openai_json(body), _JSON, headers)

    with_usage = plan.include_usage_chunk

    def chunk(choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> bytes:
        frame = completion(choices)
        if with_usage:
            frame["usage"] = usage_value
        return _data(frame)

    deltas = tuple(chunk([choice(word, None)]) for word in plan.words)
    epilogue = [chunk([choice("", finish)])]
    if with_usage:
        epilogue.append(chunk([], usage))
    epilogue.append(_DONE)
    return _Script(_SSE, headers, (), deltas, tuple(epilogue), streaming=True)


def _responses_script(plan: _Plan) -> _Script:
    headers = _openai_headers(plan)
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
            "usage": usage if done and plan.report_usage else None,
            "user": None,
            "metadata": {},
        }

    final_output = [message_item(final_status, [text_part])]
    if not plan.stream:
        return _json_script(
            _openai_json(response(final_status, final_output, done=True)), _JSON, headers
        )

    sequence = itertools.count()

    def event(name: str, **fields: Any) -> bytes:
        return _event(name, _compact({"type": name, **fields, "sequence_number": next(sequence)}))

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
    return _Script(_SSE, headers, prelude, deltas, epilogue, streaming=True)


def _embeddings_script(plan: _Plan) -> _Script:
    raw_input = plan.body.get("input")
    # A list of ints is one tokenised input; any other list holds one input per element.
    if isinstance(raw_input, list) and not all(
        isinstance(x, int) and not isinstance(x, bool) for x in raw_input
    ):
        count = len(raw_input)
    else:
        count = 1
    dimensions = plan.body.get("dimensions")
    if not (isinstance(dimensions, int) and 0 < dimensions <= _MAX_DIMENSIONS):
        dimensions = _DEFAULT_DIMENSIONS
    as_base64 = plan.body.get("encoding_format") == "base64"
    data = []
    for index in range(count):
        vector = [((index * 31 + j * 7) % 200 - 100) / 1000 for j in range(dimensions)]
        embedding: object = vector
        if as_base64:
            # The SDKs ask for base64 by default: little-endian float32, as the real API sends.
            embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    body: dict[str, Any] = {"object": "list", "data": data, "model": plan.model}
    if plan.report_usage:
        tokens = plan.usage.input_tokens
        body["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
    return _json_script(_openai_json(body), _JSON, _openai_headers(plan))


def _messages_script(plan: _Plan) -> _Script:
    headers = {"request-id": plan.request_id}
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
        return _json_script(_anthropic_json(body), _JSON, headers)

    def event(payload: dict[str, Any]) -> bytes:
        return _event(payload["type"], _compact(payload))

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
        _event("ping", '{"type": "ping"}'),
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
    return _Script(_SSE, headers, prelude, deltas, epilogue, streaming=True)


_BUILDERS: Final[Mapping[Kind, Callable[[_Plan], _Script]]] = {
    "chat": _chat_script,
    "completions": _completions_script,
    "responses": _responses_script,
    "embeddings": _embeddings_script,
    "messages": _messages_script,
}


# ---------------------------------------------------------------------------------------------
# Errors

_OPENAI_ERRORS: Final[Mapping[int, tuple[str, str | None]]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}
_ANTHROPIC_ERRORS: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def _error_response(kind: Kind, status: int, message: str, request_id: str) -> Response:
    if kind == "messages":
        error_type = _ANTHROPIC_ERRORS.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        body = {
            "type": "error",
            "error": {"type": error_type, "message": message},
            "request_id": request_id,
        }
        return Response(_anthropic_json(body), status, {"request-id": request_id}, media_type=_JSON)
    default = ("server_error", None) if status >= 500 else ("invalid_request_error", None)
    error_type, code = _OPENAI_ERRORS.get(status, default)
    envelope = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return Response(_openai_json(envelope), status, {"x-request-id": request_id}, media_type=_JSON)


# ---------------------------------------------------------------------------------------------
# The ASGI response that can stall or be cut off


async def _wait_for_disconnect(receive: Receive) -> None:
    # The request body was read already, so the next message is the disconnect. Through
    # httpx.ASGITransport it never comes while the response is unfinished: the stall then lasts
    # until the caller cancels, which is what a hung provider looks like.
    while (await receive())["type"] != "http.disconnect":
        pass


class _ScriptedResponse(Response):
    def __init__(self, script: _Script, *, stall_after: int | None, stop_after: int | None):
        self.status_code = 200
        self.media_type = script.media_type
        self.background = None
        self.raw_headers = [
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in script.headers.items()),
            (b"content-type", script.media_type.encode("latin-1")),
        ]
        self._script = script
        # Whichever failure comes first wins; on a tie the abrupt end does.
        self._stop = stop_after is not None and (stall_after is None or stop_after <= stall_after)
        self._cut = stop_after if self._stop else stall_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        script, cut = self._script, self._cut
        parts = (*script.prelude, *script.deltas, *script.epilogue)
        if cut is not None and not script.streaming:
            await self._fail_whole_body(parts[0], receive, send)
            return
        # Cut before the (cut+1)-th delta, or before the epilogue when there are fewer deltas:
        # a cut stream never reaches its finish/usage frames.
        stop_at = len(parts) if cut is None else len(script.prelude) + min(cut, len(script.deltas))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for part in parts[:stop_at]:
                await send({"type": "http.response.body", "body": part, "more_body": True})
            if cut is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        except OSError:
            # ASGI 2.4 servers raise OSError from send() once the client is gone. A real
            # provider just stops generating; so does the fake, without an error log per drop.
            return
        if self._stop:
            raise UpstreamAborted(f"fake upstream cut the stream after {cut} content chunks")
        await _wait_for_disconnect(receive)

    async def _fail_whole_body(self, payload: bytes, receive: Receive, send: Send) -> None:
        if not self._stop:
            # A stalled non-streaming answer: no status, no headers, nothing.
            await _wait_for_disconnect(receive)
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            head = payload[: len(payload) // 2]
            await send({"type": "http.response.body", "body": head, "more_body": True})
        except OSError:
            return
        raise UpstreamAborted("fake upstream cut the response body in half")


# ---------------------------------------------------------------------------------------------
# The app


class FakeUpstream(Starlette):
    """The fake provider: ``received`` keeps the last 1000 requests, ``request_count`` all."""

    def __init__(self, options: _Options) -> None:
        self.options = options
        self.received: deque[ReceivedRequest] = deque(maxlen=_RECEIVED_LIMIT)
        self.request_count = 0
        self._ids = itertools.count(1)
        super().__init__(
            routes=[
                Route(path, self._endpoint(path, kind), methods=["POST"])
                for path, kind in ROUTES.items()
            ]
        )

    def _endpoint(self, path: str, kind: Kind) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await self._handle(request, path, kind)

        return endpoint

    async def _handle(self, request: Request, path: str, kind: Kind) -> Response:
        serial = next(self._ids)
        request_id = f"req_fake{serial:012d}"
        raw = await request.body()
        self.request_count += 1
        self.received.append(ReceivedRequest(path, dict(request.headers), raw))
        try:
            options = _options_for(self.options, request.headers)
        except ValueError as exc:
            return _error_response(kind, 400, str(exc), request_id)
        if options.delay > 0:
            await anyio.sleep(options.delay)
        if options.fail_status is not None:
            message = f"Simulated upstream error {options.fail_status} (spendguard.testing)."
            return _error_response(kind, options.fail_status, message, request_id)

        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return _error_response(kind, 400, "The request body is not valid JSON.", request_id)
        if not isinstance(body, dict):
            return _error_response(kind, 400, "The request body must be a JSON object.", request_id)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _error_response(kind, 400, "model: a model name is required.", request_id)
        if kind == "embeddings" and not body.get("input"):
            return _error_response(kind, 400, "input: a non-empty input is required.", request_id)

        words = _word_count(kind, body, options.chunks)
        plan = _Plan(
            kind=kind,
            body=body,
            model=model,
            stream=kind != "embeddings" and body.get("stream") is True,
            words=tuple(_words(words)),
            usage=expected_usage(
                path, body, chunks=options.chunks, output_tokens=options.output_tokens
            ),
            truncated=words < options.chunks,
            report_usage=options.report_usage,
            request_id=request_id,
            response_id=_response_id(kind, serial),
            created=int(time.time()),
        )
        return _ScriptedResponse(
            _BUILDERS[kind](plan), stall_after=options.stall_after, stop_after=options.stop_after
        )


def _response_id(kind: Kind, serial: int) -> str:
    prefix = {
        "chat": "chatcmpl-",
        "completions": "cmpl-",
        "responses": "resp_",
        "embeddings": "emb-",
        "messages": "msg_",
    }[kind]
    return f"{prefix}fake{serial:012d}"


def fake_upstream(
    *,
    report_usage: bool = True,
    fail_status: int | None = None,
    stall_after: int | None = None,
    stop_after: int | None = None,
    chunks: int = 5,
    output_tokens: int | None = None,
    delay: float = 0.0,
) -> FakeUpstream:
    """A fake OpenAI + Anthropic provider as an ASGI app.

    * ``report_usage=False``: no usage anywhere (no ``usage`` key; ``"usage": null`` in
      Responses objects, whose schema always has the key).
    * ``fail_status``: every request answers this status with the provider's error envelope.
    * ``stall_after=N``: a stream sends its prelude and N content chunks, then waits until the
      client disconnects or the app is cancelled. A non-streaming request never gets a response.
    * ``stop_after=N``: a stream sends its prelude and N content chunks, then raises
      :class:`UpstreamAborted` so the server drops the connection. A non-streaming response sends
      its headers and half its body first.
    * ``chunks``: words in the answer; ``output_tokens``: reported output count (default: the
      number of words), e.g. to simulate reasoning tokens.
    * ``delay``: seconds to wait before answering.

    Each option can be overridden for one request by a header: ``x-fake-fail: 500`` (``0`` for
    none), ``x-fake-usage: 0|1``, ``x-fake-stall-after: N``, ``x-fake-stop-after: N``,
    ``x-fake-chunks: N``, ``x-fake-output-tokens: N`` and ``x-fake-delay: SECONDS`` (``none``
    clears an optional one). A bad header value, a non-JSON body or a missing model gets a 400 in
    the provider's error envelope.

    ``httpx.ASGITransport`` buffers whole responses: through it a stream arrives in one piece
    and a stall yields no response at all until the caller cancels. Serve the app with uvicorn
    to see chunks arrive one by one.
    """
    return FakeUpstream(
        _Options(
            report_usage=report_usage,
            fail_status=fail_status,
            stall_after=stall_after,
            stop_after=stop_after,
            chunks=chunks,
            output_tokens=output_tokens,
            delay=delay,
        )
    )


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """An httpx transport that calls an ASGI app in process and streams its response.

    ``httpx.ASGITransport`` collects the whole body before returning; this one hands chunks
    over as the app sends them, and closing the response tells the app the client left
    (``http.disconnect``), as a real server would. Used by the demo gateway to reach the fake
    upstream, and by tests that need streaming and disconnects without sockets. asyncio only.
    """

    def __init__(self, app: ASGIApp, *, client: tuple[str, int] = ("127.0.0.1", 123)) -> None:
        self.app = app
        self.client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "root_path": "",
            "query_string": request.url.query,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": self.client,
            "server": (request.url.host, request.url.port or 80),
            "state": {},
        }
        loop = asyncio.get_running_loop()
        started: asyncio.Future[Message] = loop.create_future()
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                if gone.is_set():
                    raise OSError("client disconnected")
                if message.get("body"):
                    chunks.put_nowait(message["body"])
                if not message.get("more_body", False):
                    chunks.put_nowait(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                if not started.done():
                    started.set_exception(httpx.RemoteProtocolError(f"app failed: {exc!r}"))
                chunks.put_nowait(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                chunks.put_nowait(None)

        task = loop.create_task(run())
        try:
            start = await started
        except BaseException:
            gone.set()
            task.cancel()
            raise
        headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        return httpx.Response(
            start["status"], headers=headers, stream=_AppStream(chunks, task, gone)
        )


class _AppStream(httpx.AsyncByteStream):
    def __init__(
        self,
        chunks: asyncio.Queue[bytes | BaseException | None],
        task: asyncio.Task[None],
        gone: asyncio.Event,
    ) -> None:
        self._chunks, self._task, self._gone = chunks, task, gone

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._chunks.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise httpx.RemoteProtocolError(f"peer closed the stream: {item!r}")
            yield item

    async def aclose(self) -> None:
        self._gone.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        except BaseException:
            pass  # the app's failure was already reported through the stream
