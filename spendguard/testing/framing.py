"""How each provider frames its bytes: JSON bodies, SSE frames, media types, request-id headers.

OpenAI and Anthropic differ in small visible ways (pretty-printed vs compact JSON, ``data:``-only
vs named SSE events, ``x-request-id`` vs ``request-id``); the fake copies each exactly.
"""

from __future__ import annotations

import json
from typing import Final

SSE: Final = "text/event-stream; charset=utf-8"
JSON: Final = "application/json"
DONE: Final = b"data: [DONE]\n\n"
"""The frame that ends a Chat/Completions stream."""


def compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def openai_json(obj: object) -> bytes:
    # OpenAI pretty-prints JSON bodies with two spaces and a trailing newline.
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def anthropic_json(obj: object) -> bytes:
    # Anthropic sends compact single-line JSON without a trailing newline.
    return compact(obj).encode()


def data_frame(obj: object) -> bytes:
    """Chat/Completions SSE frame: ``data:`` lines only, no ``event:``."""
    return f"data: {compact(obj)}\n\n".encode()


def event_frame(name: str, payload: str) -> bytes:
    """Responses/Anthropic SSE frame: an ``event:`` line names every ``data:`` line."""
    return f"event: {name}\ndata: {payload}\n\n".encode()


def openai_headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id}


def anthropic_headers(request_id: str) -> dict[str, str]:
    return {"request-id": request_id}
