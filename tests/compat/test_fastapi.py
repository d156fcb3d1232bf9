"""The FastAPI gateway of docs/integrations/fastapi.md: its own auth dependency, then
``spendguard_guard``, in front of the fake provider; default spendguard settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .forward_gateway import OPEN_KEY, ZERO_KEY, Gateway, prepare
from .support import (
    Answer,
    Provider,
    is_spend_refusal,
    price,
    raw_post,
    serve,
    served_once,
    settled_charges,
)

pytestmark = [pytest.mark.timeout(120)]

MODEL = "gpt-4o-mini"
PROMPT = [{"role": "user", "content": "Name a colour, please."}]
CHAT = {"model": MODEL, "messages": PROMPT}
MESSAGE = {"model": "claude-sonnet-4-6", "max_tokens": 50, "messages": PROMPT}
RESPONSE = {"model": MODEL, "input": "Name a colour."}


@pytest.fixture(scope="module")
def gateway(provider: Provider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    into = Path(tmp_path_factory.mktemp("fastapi"))
    launch, env = prepare(into, "fastapi.md", PROVIDER_URL=provider.server.base)
    launch.ready = "/"  # the page's app has no health route: any answer will do
    server = serve(launch)
    try:
        yield Gateway(server, env, into / "spendguard.db")
    finally:
        server.stop()


def post(gw: Gateway, path: str, body: dict[str, Any], headers: dict[str, str]) -> Answer:
    return raw_post(gw.port, path, body, headers)


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/chat/completions", CHAT, {"authorization": f"Bearer {ZERO_KEY}"}),
        ("/v1/responses", RESPONSE, {"authorization": f"Bearer {ZERO_KEY}"}),
        ("/v1/messages", MESSAGE, {"x-api-key": ZERO_KEY}),  # the Anthropic SDK's header
        ("/v1//chat/completions", CHAT, {"authorization": f"Bearer {ZERO_KEY}"}),
    ],
)
def test_a_key_at_zero_is_refused_after_the_apps_auth(
    gateway: Gateway, provider: Provider, path: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    before = provider.count()
    answer = post(gateway, path, body, headers)
    assert is_spend_refusal(answer), (answer.status, answer.body[:300])
    assert provider.count() == before


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGE)]
)
def test_a_key_at_a_limit_is_served_and_charged_once(
    gateway: Gateway, provider: Provider, path: str, body: dict[str, Any]
) -> None:
    before = provider.count()
    headers = {"authorization": f"Bearer {OPEN_KEY}"}
    answer, upstream = served_once(provider, before, lambda: post(gateway, path, body, headers))
    (charge,) = settled_charges(gateway.database, answer.headers["x-spendguard-inference-id"])
    tokens_in, tokens_out, cost = price(body["model"], upstream)
    assert (charge.model, charge.input_tokens, charge.output_tokens) == (
        body["model"],
        tokens_in,
        tokens_out,
    )
    assert charge.amount_micros == cost > 0


def test_a_bad_key_gets_the_apps_own_401(gateway: Gateway, provider: Provider) -> None:
    before = provider.count()
    answer = post(gateway, "/v1/chat/completions", CHAT, {"authorization": "Bearer sk-no"})
    assert (answer.status, answer.json()) == (401, {"detail": "Invalid API key"})
    assert "x-spendguard-inference-id" not in answer.headers
    assert provider.count() == before


def test_an_endpoint_spendguard_cant_price_is_refused(gateway: Gateway, provider: Provider) -> None:
    before = provider.count()
    body = {"model": "gpt-image-1", "prompt": "a red square"}
    answer = post(gateway, "/v1/images/generations", body, {"authorization": f"Bearer {OPEN_KEY}"})
    assert answer.status == 403, (answer.status, answer.body[:300])
    assert provider.count() == before
