"""Inference that no listed route names: every spelling of a guarded route is guarded, and a
request that looks like an inference on any other route is refused (or, opted in, warned
about), never silent. The app here is a catch-all provider that serves any path, as a
forwarding gateway does, and counts what reached it."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from spendguard import SpendGuardMiddleware
from spendguard.limits import Period
from tests.support import StateAuth, chat_body
from tests.support.gateway import MODEL, Gateway
from tests.support.paths import CHAT_SPELLINGS

pytestmark = pytest.mark.anyio

METHODS = ["POST", "PUT", "PATCH"]


class Provider:
    """Serves every path like a chat completion (10 + 5 tokens); remembers what reached it."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, str, bytes]] = []
        self.app = Starlette(routes=[Route("/{path:path}", self.serve, methods=METHODS)])

    async def serve(self, request: Request) -> Response:
        body = await request.body()
        self.reached.append((request.method, request.scope["path"], body))
        if request.scope["path"].startswith("/missing"):
            return JSONResponse({"error": "no such route"}, status_code=404)
        try:
            sent = json.loads(body)
        except ValueError:
            sent = None
        model = (sent.get("model") if isinstance(sent, dict) else None) or MODEL
        usage = {"prompt_tokens": 10, "completion_tokens": 5}
        return JSONResponse({"object": "chat.completion", "model": model, "usage": usage})


@pytest.fixture
async def provider() -> Provider:
    return Provider()


async def forwarding(tmp_path: Path, provider: Provider, **settings: Any) -> Gateway:
    gw = Gateway(tmp_path, **settings)
    gw.app = StateAuth(SpendGuardMiddleware(provider.app, guard=gw.guard))
    return gw


@pytest.fixture
async def gw(tmp_path: Path, provider: Provider) -> AsyncIterator[Gateway]:
    async with await forwarding(tmp_path, provider) as gateway:
        yield gateway


def counted(action: str) -> float:
    return REGISTRY.get_sample_value("spendguard_unlisted_inference_total", {"action": action}) or 0


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def send_raw(gw: Gateway, method: str, path: str, body: bytes, content_type: str) -> Any:
    """One request with its path exactly as written (httpx would normalise some spellings)."""
    from tests.support.asgi import http_scope

    scope = http_scope(method, path, [(b"content-type", content_type.encode())], body)
    sent: list[Message] = []
    chunks = [body[: len(body) // 2], body[len(body) // 2 :]]

    async def receive() -> Message:
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await gw.app(scope, receive, send)
    status = sent[0]["status"]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(content) if content.startswith(b"{") else content


# -- every spelling of a guarded route is that route ------------------------------------------
VARIANTS = [
    "/v1/chat/completions",
    "/chat/completions",
    "/openai/v1/chat/completions",
    *CHAT_SPELLINGS,
    "/v1/chat%252Fcompletions",
    "/V1/CHAT/COMPLETIONS",
    "/v1/responses",
    "/responses",
    "/v1/responses/compact",
    "/embeddings",
    "/v1/messages",
    "/openai/deployments/unit-model/chat/completions",
    "/engines/unit-model/chat/completions",
    "/queue/chat/completions",
]


@pytest.mark.parametrize("path", VARIANTS)
async def test_at_a_zero_limit_no_spelling_reaches_the_provider(
    gw: Gateway, provider: Provider, path: str
) -> None:
    await gw.policy(Period.DAY, 0)
    body = json.dumps({**chat_body(), "input": "hi", "max_tokens": 5}).encode()
    status, answer = await send_raw(gw, "POST", path, body, "application/json")
    assert status == 429, answer
    assert provider.reached == []


async def test_a_limit_charges_each_spelling_once(gw: Gateway, provider: Provider) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    body = json.dumps(chat_body()).encode()
    for path in VARIANTS[:13]:
        status, _ = await send_raw(gw, "POST", path, body, "application/json")
        assert status == 200
    await gw.settle()
    assert len(provider.reached) == 13
    assert await gw.guard.ledger.charges_total() == 13 * 15


async def test_a_deployment_route_without_a_model_in_the_body_is_priced_by_its_path(
    gw: Gateway, provider: Provider
) -> None:
    """Azure's deployments name the model in the path; the body needs none."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    path = f"/openai/deployments/{MODEL}/chat/completions?api-version=2024-10-21"
    status, answer = await send_raw(gw, "POST", path.split("?")[0], body, "application/json")
    assert status == 200, answer
    await gw.settle()
    assert await gw.guard.ledger.charges_total() == 15  # the unit model's price, not a default


async def test_an_ambiguous_path_is_a_400_and_reaches_nothing(
    gw: Gateway, provider: Provider
) -> None:
    body = json.dumps(chat_body()).encode()
    status, answer = await send_raw(
        gw, "POST", "/v1/chat%FF/completions".replace("%FF", "\x00"), body, "application/json"
    )
    assert status == 400 and answer["error"]["code"] == "invalid_request_path"
    assert provider.reached == []


# -- the safety net ------------------------------------------------------------------------------
INFERENCE_LIKE = [
    ("application/json", json.dumps(chat_body()).encode()),
    ("application/json", json.dumps({"model": "dall-e-3", "prompt": "a cat"}).encode()),
    ("application/json", json.dumps({"model": "tts-1", "input": "hello"}).encode()),
    (
        "application/json",
        json.dumps({"model": "rerank-v3", "query": "q", "documents": []}).encode(),
    ),
    ("application/json", json.dumps({"contents": [{"role": "user", "parts": []}]}).encode()),
    ("application/json", b'{"\\u006dodel": "unit-model", "messages": []}'),  # escaped key
    ("application/json", b'{"\\u006dodel": "unit-model", "\\u0070rompt": "hi"}'),  # both
    ("text/plain", b'  {"model": "unit-model", "prompt": "hi"}'),
    (
        "multipart/form-data; boundary=x",
        b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n--x--\r\n',
    ),
    ("application/x-www-form-urlencoded", b"model=gpt-4o&prompt=hi"),
]


@pytest.mark.parametrize(("content_type", "body"), INFERENCE_LIKE)
@pytest.mark.parametrize("method", METHODS)
async def test_an_unlisted_inference_is_refused_before_the_app(
    gw: Gateway, provider: Provider, method: str, content_type: str, body: bytes
) -> None:
    before = counted("refused")
    status, answer = await send_raw(gw, method, "/v1/images/generations", body, content_type)
    assert status == 403
    assert answer["error"]["code"] == "unguarded_inference_route"
    assert "SPENDGUARD_ROUTES" in answer["error"]["message"]
    assert provider.reached == []
    assert counted("refused") == before + 1
    assert set(gw.store.calls) <= {"start"}  # nothing admitted, nothing charged


async def test_a_refusal_is_logged_once_per_route(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    body = json.dumps(chat_body()).encode()
    for path in ["/custom/generate", "/custom/generate", "/custom//generate", "/other"]:
        await send_raw(gw, "POST", path, body, "application/json")
    said = warnings(caplog)
    assert len(said) == 2
    assert "/custom/generate" in said[0] and "refused" in said[0]
    assert "/other" in said[1]


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b'{"key_alias": "team-a", "models": ["gpt-4o"]}'),
        ("application/json", b'{"model": "gpt-4o"}'),  # a model, but nothing asked of it
        ("application/json", b"[1, 2, 3]"),
        ("application/json", b"{not json"),
        ("multipart/form-data; boundary=x", b'--x\r\nname="file"\r\n\r\nabc\r\n--x--\r\n'),
        ("application/octet-stream", b"\x00\x01binary"),
    ],
)
async def test_other_posts_reach_the_app_byte_for_byte(
    gw: Gateway, provider: Provider, content_type: str, body: bytes
) -> None:
    status, _ = await send_raw(gw, "POST", "/key/generate", body, content_type)
    assert status == 200
    assert provider.reached == [("POST", "/key/generate", body)]


async def test_token_counters_pass_as_pass_routes(gw: Gateway, provider: Provider) -> None:
    body = json.dumps(chat_body()).encode()
    for path in ["/v1/messages/count_tokens", "/utils/token_counter"]:
        status, _ = await send_raw(gw, "POST", path, body, "application/json")
        assert status == 200
    assert [path for _, path, _ in provider.reached] == [
        "/v1/messages/count_tokens",
        "/utils/token_counter",
    ]
    assert set(gw.store.calls) <= {"start"}


async def test_a_body_beyond_the_limit_passes_unread_and_counted(
    tmp_path: Path, provider: Provider
) -> None:
    before = counted("uninspected")
    async with await forwarding(tmp_path, provider, max_body_bytes=1024) as gw:
        body = json.dumps({**chat_body(), "pad": "x" * 4000}).encode()
        status, _ = await send_raw(gw, "POST", "/v1/files", body, "application/json")
    assert status == 200
    assert provider.reached == [("POST", "/v1/files", body)]  # the whole body, replayed
    assert counted("uninspected") == before + 1


async def test_warn_mode_passes_and_warns_once_when_the_app_serves_it(
    tmp_path: Path, provider: Provider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard")
    before = counted("passed")
    body = json.dumps(chat_body()).encode()
    async with await forwarding(tmp_path, provider, unlisted_inference="warn") as gw:
        for path in ["/custom/generate", "/custom/generate", "/missing/route"]:
            await send_raw(gw, "POST", path, body, "application/json")
    assert len(provider.reached) == 3
    said = warnings(caplog)
    assert len(said) == 1 and "/custom/generate" in said[0] and "UNLIMITED" in said[0]
    assert counted("passed") == before + 2  # the 404 was not served


async def test_a_route_added_to_the_list_is_guarded_instead(
    tmp_path: Path, provider: Provider
) -> None:
    async with await forwarding(tmp_path, provider, routes="default,/custom/generate") as gw:
        await gw.policy(Period.DAY, 0)
        body = json.dumps(chat_body()).encode()
        status, answer = await send_raw(gw, "POST", "/custom/generate", body, "application/json")
        ok, _ = await send_raw(gw, "POST", "/v1/chat/completions", body, "application/json")
    assert status == 429 and answer["error"]["code"] == "spend_limit_exceeded"
    assert ok == 429  # the defaults are still there
    assert provider.reached == []


async def test_the_path_model_wins_over_the_body_and_the_response(
    gw: Gateway, provider: Provider
) -> None:
    """A deployment runs the model it names: the body's model (which the provider here echoes,
    as LiteLLM does) does not price the inference."""
    assert gw.guard.coster.is_priced("gpt-4o")
    body = json.dumps({**chat_body(), "model": "gpt-4o"}).encode()
    for path in [f"/openai/deployments/{MODEL}/chat/completions", f"/engines/{MODEL}/completions"]:
        status, answer = await send_raw(gw, "POST", path, body, "application/json")
        assert status == 200 and answer["model"] == "gpt-4o"
    await gw.settle()
    assert await gw.guard.ledger.charges_total() == 2 * 15  # the unit model's 10 + 5 tokens
