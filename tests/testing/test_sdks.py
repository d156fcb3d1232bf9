"""The official openai and anthropic SDKs, sync and async, streaming and not, through
spendguard.testing's transport: against the fake provider, and through the middleware in front
of it (the gateway charges exactly what the fake reported; a spend denial is not retried).

anthropic>=2 speaks only httpx2; openai accepts an httpx or an httpx2 client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
from anyio.from_thread import BlockingPortal
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard import SpendGuardMiddleware
from spendguard.limits import Period
from spendguard.testing import StreamingASGITransport, expected_text, expected_usage, fake_upstream
from tests.support import UNIT_MODEL, Gateway, StateAuth
from tests.testing.wire import TIME_LIMIT

try:
    import httpx2 as anthropic_http  # anthropic>=2
except ImportError:  # pragma: no cover - depends on the installed SDK
    anthropic_http = httpx  # type: ignore[no-redef]

pytestmark = pytest.mark.anyio

PROMPT = "Name three cats, please."
CHAT_PATH, MESSAGES_PATH = "/v1/chat/completions", "/v1/messages"


def chat_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": UNIT_MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def message_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": UNIT_MODEL,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    return body | {"stream": True} if stream else body


@dataclass(frozen=True)
class Answer:
    text: str
    input_tokens: int
    output_tokens: int


# -- one call per SDK, mode and shape --------------------------------------------------------


def openai_sync(transport: StreamingASGITransport, stream: bool, **options: Any) -> Answer:
    with openai.OpenAI(
        base_url="http://gw/v1",
        api_key="x",
        http_client=httpx.Client(transport=transport),
        **options,
    ) as client:
        if not stream:
            done = client.chat.completions.create(**chat_body(False))
            assert done.usage is not None
            text = done.choices[0].message.content or ""
            return Answer(text, done.usage.prompt_tokens, done.usage.completion_tokens)
        parts, usage = [], None
        for chunk in client.chat.completions.create(**chat_body(True)):
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert usage is not None
        return Answer("".join(parts), usage.prompt_tokens, usage.completion_tokens)


async def openai_async(transport: StreamingASGITransport, stream: bool, **options: Any) -> Answer:
    async with openai.AsyncOpenAI(
        base_url="http://gw/v1",
        api_key="x",
        http_client=httpx.AsyncClient(transport=transport),
        **options,
    ) as client:
        if not stream:
            done = await client.chat.completions.create(**chat_body(False))
            assert done.usage is not None
            text = done.choices[0].message.content or ""
            return Answer(text, done.usage.prompt_tokens, done.usage.completion_tokens)
        parts, usage = [], None
        async for chunk in await client.chat.completions.create(**chat_body(True)):
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert usage is not None
        return Answer("".join(parts), usage.prompt_tokens, usage.completion_tokens)


def anthropic_sync(transport: StreamingASGITransport, stream: bool, **options: Any) -> Answer:
    http_client = anthropic_http.Client(transport=transport)
    with anthropic.Anthropic(
        base_url="http://gw", api_key="x", http_client=http_client, **options
    ) as client:
        body = message_body(False)
        if not stream:
            done = client.messages.create(**body)
        else:
            with client.messages.stream(**body) as events:
                assert "".join(events.text_stream)
                done = events.get_final_message()
        text = "".join(block.text for block in done.content if block.type == "text")
        return Answer(text, done.usage.input_tokens, done.usage.output_tokens)


async def anthropic_async(
    transport: StreamingASGITransport, stream: bool, **options: Any
) -> Answer:
    http_client = anthropic_http.AsyncClient(transport=transport)
    async with anthropic.AsyncAnthropic(
        base_url="http://gw", api_key="x", http_client=http_client, **options
    ) as client:
        body = message_body(False)
        if not stream:
            done = await client.messages.create(**body)
        else:
            async with client.messages.stream(**body) as events:
                assert "".join([text async for text in events.text_stream])
                done = await events.get_final_message()
        text = "".join(block.text for block in done.content if block.type == "text")
        return Answer(text, done.usage.input_tokens, done.usage.output_tokens)


SyncCall = Callable[..., Answer]
CALLS: dict[str, tuple[str, Callable[..., Any], bool]] = {
    "openai-sync": (CHAT_PATH, openai_sync, False),
    "openai-async": (CHAT_PATH, openai_async, True),
    "anthropic-sync": (MESSAGES_PATH, anthropic_sync, False),
    "anthropic-async": (MESSAGES_PATH, anthropic_async, True),
}


def expected(path: str, stream: bool) -> Answer:
    body = chat_body(stream) if path == CHAT_PATH else message_body(stream)
    usage = expected_usage(path, body)
    return Answer(expected_text(path, body), usage.input_tokens, usage.output_tokens)


async def call(
    name: str, transport: StreamingASGITransport, stream: bool, **options: Any
) -> Answer:
    _, function, is_async = CALLS[name]
    options.setdefault("max_retries", 0)
    if is_async:
        result: Answer = await function(transport, stream, **options)
        return result
    # A sync client blocks its thread: it runs in a worker thread while this loop serves it.
    return await anyio.to_thread.run_sync(lambda: function(transport, stream, **options))


# -- against the fake provider ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", list(CALLS))
async def test_each_sdk_reads_the_fake_provider(name: str, stream: bool) -> None:
    path = CALLS[name][0]
    app = fake_upstream()
    with anyio.fail_after(TIME_LIMIT):
        # The sync client gets the transport's own event loop in a thread of its own.
        transport = StreamingASGITransport(app)
        try:
            answer = await call(name, transport, stream)
        finally:
            transport.close()
    assert answer == expected(path, stream)
    assert app.request_count == 1


# -- through the middleware ------------------------------------------------------------------


class Counted:
    """Counts the HTTP requests that reach the gateway."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.requests += 1
        await self.app(scope, receive, send)


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[Gateway, Counted, StreamingASGITransport]]:
    """The middleware (unit prices) in front of the fake provider; the transport runs sync
    clients on this test's event loop, where the guard lives."""
    async with Gateway(tmp_path) as gw, BlockingPortal() as portal:
        counted = Counted(StateAuth(SpendGuardMiddleware(fake_upstream(), guard=gw.guard)))
        yield gw, counted, StreamingASGITransport(counted, portal=portal)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", list(CALLS))
async def test_each_sdk_through_the_middleware_is_charged_what_the_fake_reported(
    tmp_path: Path, name: str, stream: bool
) -> None:
    path = CALLS[name][0]
    with anyio.fail_after(TIME_LIMIT):
        async with gateway(tmp_path) as (gw, counted, transport):
            answer = await call(name, transport, stream)
            await gw.settle()
            charged = await gw.guard.ledger.charges_total()
    assert answer == expected(path, stream)
    # One micro-USD per token (the unit price table).
    assert charged == answer.input_tokens + answer.output_tokens
    assert counted.requests == 1


@pytest.mark.parametrize("name", list(CALLS))
async def test_a_spend_limit_429_is_raised_by_the_sdk_without_retries(
    tmp_path: Path, name: str
) -> None:
    errors = (openai.RateLimitError, anthropic.RateLimitError)
    with anyio.fail_after(TIME_LIMIT):
        async with gateway(tmp_path) as (gw, counted, transport):
            await gw.policy(Period.DAY, 0)
            # The SDKs' own default: two retries on a 429 unless told not to.
            with pytest.raises(errors) as denied:
                await call(name, transport, False, max_retries=2)
    assert counted.requests == 1
    assert denied.value.status_code == 429
    assert denied.value.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("name", ["openai-async", "anthropic-sync"])
async def test_a_balance_429_is_raised_by_the_sdk_without_retries(
    tmp_path: Path, name: str
) -> None:
    errors = (openai.RateLimitError, anthropic.RateLimitError)
    with anyio.fail_after(TIME_LIMIT):
        async with gateway(tmp_path) as (gw, counted, transport):
            await gw.guard.admin.topup("acme", Decimal("0.000001"))
            await call(name, transport, False)  # allowed: the balance had 1 micro-USD left
            with pytest.raises(errors) as denied:
                await call(name, transport, False, max_retries=2)
    assert "balance" in str(denied.value.message).lower()
    assert counted.requests == 2
