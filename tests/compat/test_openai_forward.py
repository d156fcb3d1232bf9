"""openai-forward (a catch-all forwarding proxy) wrapped as docs/integrations/openai-forward.md
shows, default spendguard settings, in front of the fake provider.

openai-forward forwards any method on any path, and collapses ``//``, drops a trailing ``/``
and (through aiohttp) resolves ``.``/``..`` before it does: every spelling of an inference path
reaches the provider as that path. So each spelling must be refused at $0 and charged once
at a limit, like the plain path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import CHAT_SPELLINGS

from .forward_gateway import OPEN_KEY, ZERO_KEY, Gateway, forward_config, prepare
from .support import (
    Provider,
    is_spend_refusal,
    price,
    raw_post,
    serve,
    served_once,
    settled_charges,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("openai_forward_installed")]

MODEL, EMBEDDING = "gpt-4o-mini", "text-embedding-3-small"
PROMPT = [{"role": "user", "content": "Name a colour, please."}]
CHAT = {"model": MODEL, "messages": PROMPT}
ROUTES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", CHAT, MODEL),
    ("/v1/completions", {"model": MODEL, "prompt": "Name a colour."}, MODEL),
    ("/v1/responses", {"model": MODEL, "input": "Name a colour."}, MODEL),
    ("/v1/embeddings", {"model": EMBEDDING, "input": "a colour"}, EMBEDDING),
    ("/v1/messages", {"model": "claude-sonnet-4-6", "max_tokens": 50, "messages": PROMPT}, ""),
]
# Spellings openai-forward forwards to /v1/chat/completions (checked: the provider gets that).
PATH_VARIANTS = list(CHAT_SPELLINGS)


@pytest.fixture(scope="module")
def gateway(
    provider: Provider, tmp_path_factory: pytest.TempPathFactory, openai_forward_installed: None
) -> Iterator[Gateway]:
    into = Path(tmp_path_factory.mktemp("openai-forward"))
    launch, env = prepare(into, "openai-forward.md", FORWARD_CONFIG=forward_config(provider))
    server = serve(launch)
    try:
        yield Gateway(server, env, into / "spendguard.db")
    finally:
        server.stop()


def post(gw: Gateway, path: str, body: dict[str, Any], key: str) -> Any:
    return raw_post(gw.port, path, body, {"authorization": f"Bearer {key}"})


@pytest.mark.parametrize(
    ("path", "body"), [(p, b) for p, b, _ in ROUTES], ids=[r[0] for r in ROUTES]
)
def test_every_inference_route_is_refused_at_zero(
    gateway: Gateway, provider: Provider, path: str, body: dict[str, Any]
) -> None:
    before = provider.count()
    answer = post(gateway, path, body, ZERO_KEY)
    assert is_spend_refusal(answer), (answer.status, answer.body[:300])
    assert provider.count() == before, "the provider was called"


@pytest.mark.parametrize("path", PATH_VARIANTS)
def test_every_spelling_is_refused_at_zero(gateway: Gateway, provider: Provider, path: str) -> None:
    before = provider.count()
    answer = post(gateway, path, CHAT, ZERO_KEY)
    assert provider.count() == before, f"{path} reached the provider: {answer.status}"
    assert is_spend_refusal(answer), (answer.status, answer.body[:300])


@pytest.mark.parametrize(
    ("path", "body", "model"),
    [*ROUTES[:4], *((p, CHAT, MODEL) for p in PATH_VARIANTS)],
    ids=[*(r[0] for r in ROUTES[:4]), *PATH_VARIANTS],
)
def test_each_forwarded_inference_is_charged_once_exactly(
    gateway: Gateway, provider: Provider, path: str, body: dict[str, Any], model: str
) -> None:
    before = provider.count()
    answer, upstream = served_once(provider, before, lambda: post(gateway, path, body, OPEN_KEY))
    if path in PATH_VARIANTS:
        assert upstream["path"] == "/v1/chat/completions"  # what openai-forward made of it
    inference = answer.headers.get("x-spendguard-inference-id")
    assert inference, f"spendguard did not see {path}"
    (charge,) = settled_charges(gateway.database, inference)
    tokens_in, tokens_out, cost = price(model, upstream)
    assert not charge.usage_estimated
    assert (charge.model, charge.input_tokens, charge.output_tokens) == (
        model,
        tokens_in,
        tokens_out,
    )
    assert charge.amount_micros == cost > 0


def test_an_anthropic_message_is_charged_once_exactly(gateway: Gateway, provider: Provider) -> None:
    path, body, _ = ROUTES[4]
    before = provider.count()
    answer, upstream = served_once(provider, before, lambda: post(gateway, path, body, OPEN_KEY))
    (charge,) = settled_charges(gateway.database, answer.headers["x-spendguard-inference-id"])
    tokens_in, tokens_out, cost = price(body["model"], upstream)
    assert (charge.input_tokens, charge.output_tokens, charge.amount_micros) == (
        tokens_in,
        tokens_out,
        cost,
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/images/generations", {"model": "gpt-image-1", "prompt": "a red square"}),
        ("/v1/moderations", {"model": "omni-moderation-latest", "input": "hello"}),
        ("/v1/audio/speech", {"model": "gpt-4o-mini-tts", "input": "hello", "voice": "alloy"}),
        ("/custom/v9/generate", {"model": MODEL, "messages": PROMPT}),
    ],
)
def test_an_unlisted_inference_is_refused_even_with_room_left(
    gateway: Gateway, provider: Provider, path: str, body: dict[str, Any]
) -> None:
    # The key may still spend: only the safety net stands between these and the provider.
    before = provider.count()
    answer = post(gateway, path, body, OPEN_KEY)
    assert provider.count() == before, f"{path} was forwarded unlimited: {answer.status}"
    assert answer.status == 403, (answer.status, answer.body[:300])


def test_an_unknown_key_gets_a_401(gateway: Gateway, provider: Provider) -> None:
    before = provider.count()
    answer = post(gateway, "/v1/chat/completions", CHAT, "sk-not-in-keys-json")
    assert answer.status == 401 and provider.count() == before
