"""What the fake-upstream tests send and read: sample bodies, clients, SSE and usage readers.

Plain helpers shared by the tests of this package: no fixtures and no tests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import anthropic
import httpx
import openai
from starlette.types import ASGIApp

from spendguard.testing import ROUTES
from tests.support.bodies import WIRE

RECORDED: Final = WIRE
"""Bodies and streams recorded from the real providers."""

TIME_LIMIT: Final = 10.0
"""Seconds any one test may wait on the fake: a broken stall must fail a test, not hang it."""

CHAT = {"model": "gpt-4o-mini-2024-07-18", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "gpt-3.5-turbo-instruct", "prompt": "Say hello to the world"}
RESPONSE = {"model": "gpt-4.1-nano", "input": "What is 2+2?", "instructions": "Be terse."}
EMBEDDING = {"model": "text-embedding-3-small", "input": ["first text", "second"]}
MESSAGE = {
    "model": "claude-sonnet-4-6",
    "max_tokens": 100,
    "system": "You are helpful.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a cat."}]}],
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSE,
    "/v1/embeddings": EMBEDDING,
    "/v1/messages": MESSAGE,
}
STREAMING_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
ROUTE_MODES = [(path, False) for path in ROUTES] + [(path, True) for path in STREAMING_PATHS]
"""(path, stream) for every answer shape: each route as JSON, each streaming route as SSE."""


def streamed(path: str) -> dict[str, Any]:
    """The sample body for ``path`` as a stream that asks for usage where that is optional."""
    body = {**BODIES[path], "stream": True}
    if path in ("/v1/chat/completions", "/v1/completions"):
        body["stream_options"] = {"include_usage": True}
    return body


@asynccontextmanager
async def openai_client(app: ASGIApp) -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        base_url="http://fake/v1", api_key="x", max_retries=0, http_client=http
    ) as client:
        yield client


def _anthropic_http_client(app: ASGIApp) -> Any:
    # anthropic>=2 runs on httpx2 and refuses httpx clients; older releases use httpx.
    try:
        import httpx2
    except ImportError:  # pragma: no cover - depends on the installed SDK
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))


@asynccontextmanager
async def anthropic_client(app: ASGIApp) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url="http://fake", api_key="x", max_retries=0, http_client=_anthropic_http_client(app)
    ) as client:
        yield client


@asynccontextmanager
async def raw_client(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://fake"
    ) as client:
        yield client


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name or None, data) for each SSE event of a body."""
    events: list[tuple[str | None, str]] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        events.append((name, "\n".join(data)))
    return events


def usage_values(obj: Any) -> list[Any]:
    """Every non-null value stored under a "usage" key, at any depth."""
    found: list[Any] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("usage") is not None:
                found.append(item["usage"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def body_usages(raw: bytes, content_type: str) -> list[Any]:
    """Every non-null usage object in a JSON body or in the events of an SSE body."""
    if content_type.startswith("text/event-stream"):
        values: list[Any] = []
        for _, data in sse_events(raw):
            if data != "[DONE]":
                values.extend(usage_values(json.loads(data)))
        return values
    return usage_values(json.loads(raw))


def is_content_delta(path: str, name: str | None, data: str) -> bool:
    """Whether an SSE event carries one generated word."""
    if data == "[DONE]":
        return False
    payload = json.loads(data)
    if path == "/v1/chat/completions":
        return bool(payload["choices"]) and bool(payload["choices"][0]["delta"].get("content"))
    if path == "/v1/completions":
        return bool(payload["choices"]) and bool(payload["choices"][0]["text"])
    if path == "/v1/responses":
        return name == "response.output_text.delta"
    return name == "content_block_delta"


def keys(obj: dict[str, Any]) -> set[str]:
    return set(obj)
