"""The LiteLLM proxy wrapped as docs/integrations/litellm.md shows, both ways: a resolver over
the page's key table (before LiteLLM's auth), and ``spendguard_guard`` after LiteLLM's own
``user_api_key_auth`` (the Depends block). Default spendguard settings, the fake provider behind.

At $0 every route and path spelling LiteLLM serves for inference is refused and the provider
never hears of it; at a limit each served inference is charged once, exactly what the fake's
usage costs at the model LiteLLM called; the official SDKs get the refusal as a RateLimitError
at once, without retrying. (LiteLLM runs without a database here, so its master key is the one
key it accepts.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2  # the SDKs' current majors speak httpx2 (anthropic accepts nothing else)
import openai
import pytest

from spendguard.testing import expected_usage
from tests.support.paths import CHAT_SPELLINGS

from .litellm_gateway import (
    ALIAS,
    CHEAP,
    CHEAP_PER_1M,
    EMBEDDING,
    MIXED,
    MIXED_IDS,
    MODEL,
    LiteLLM,
    litellm,
    litellm_launch,
    micro_usd,
    new_master_key,
    shipped_per_1m,
)
from .support import (
    Answer,
    Identity,
    Provider,
    charges_of,
    is_spend_refusal,
    price,
    raw_post,
    serve_all,
    served_once,
    set_limit,
    settled_charges,
    wait_for,
    write_keys,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("litellm_installed")]

WHO = Identity("acme", "litellm-master")  # keys.json: the master key's hash -> this identity
# What the Depends block reads from LiteLLM's UserAPIKeyAuth for the master key (no team).
DEPENDS_WHO = Identity("litellm", "litellm_proxy_master_key")
PROMPT = [{"role": "user", "content": "Name a colour, please."}]
CHAT = {"model": MODEL, "messages": PROMPT}
NO_MODEL = {"messages": PROMPT}  # the deployment or engine in the path names the model
COMPLETION = {"model": MODEL, "prompt": "Name a colour, please."}
EMBED = {"model": EMBEDDING, "input": "a colour"}
RESPONSE = {"model": MODEL, "input": "Name a colour, please."}
MESSAGE = {"model": MODEL, "max_tokens": 50, "messages": PROMPT}
AZURE = "?api-version=2024-10-21"
OTHER = "gpt-4.1-nano"  # a priced model the config does not serve

# Every POST route LiteLLM serves for an inference priced by tokens.
INFERENCE_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/chat/completions", CHAT),
    ("/v1/chat/completions", CHAT),
    ("/openai/v1/chat/completions", CHAT),  # LiteLLM's OpenAI pass-through
    ("/completions", COMPLETION),
    ("/v1/completions", COMPLETION),
    ("/embeddings", EMBED),
    ("/v1/embeddings", EMBED),
    ("/responses", RESPONSE),
    ("/v1/responses", RESPONSE),
    ("/openai/v1/responses", RESPONSE),
    ("/v1/responses/compact", RESPONSE),
    (f"/openai/deployments/{MODEL}/chat/completions{AZURE}", NO_MODEL),
    (f"/openai/deployments/{MODEL}/completions{AZURE}", {"prompt": "Name a colour."}),
    (f"/openai/deployments/{EMBEDDING}/embeddings{AZURE}", {"input": "a colour"}),
    (f"/engines/{MODEL}/chat/completions", NO_MODEL),
    ("/v1/messages", MESSAGE),
    ("/queue/chat/completions", {**CHAT, "priority": 0}),
    ("/cursor/chat/completions", CHAT),
]
# Spellings of /v1/chat/completions a client can send; sent byte for byte.
PATH_VARIANTS = list(CHAT_SPELLINGS)


@pytest.fixture(scope="module")
def gateways(
    provider: Provider, tmp_path_factory: pytest.TempPathFactory, litellm_installed: None
) -> Iterator[tuple[LiteLLM, LiteLLM]]:
    """Both of the page's gateways, started at once (LiteLLM takes ~10-20 s to import)."""
    key = new_master_key()
    first, second = Path(tmp_path_factory.mktemp("litellm")), Path(tmp_path_factory.mktemp("dep"))
    write_keys(first, {key: (WHO.team, WHO.key_id)})  # the page's keys.json
    # Every setting default: no price file, the aliases are priced from LiteLLM's model_list.
    (resolver, env), (depends, denv) = (
        litellm_launch(first, provider, "gateway.py", key),
        litellm_launch(second, provider, "gateway_depends.py", key),
    )
    servers = serve_all(resolver, depends)
    WHO.limit = DEPENDS_WHO.limit = None
    try:
        yield litellm(servers[0], key, env), litellm(servers[1], key, denv)
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def gateway(gateways: tuple[LiteLLM, LiteLLM]) -> LiteLLM:
    """The resolver block: identity from the key table, before LiteLLM's auth."""
    return gateways[0]


@pytest.fixture(scope="module")
def depends_gateway(gateways: tuple[LiteLLM, LiteLLM]) -> LiteLLM:
    """The Depends block: LiteLLM's own auth, then spendguard_guard."""
    return gateways[1]


def post(gw: LiteLLM, path: str, body: dict[str, Any]) -> Answer:
    return raw_post(gw.port, path, body, gw.headers())


def refused(gw: LiteLLM) -> bool:
    """One chat completion: refused for a spent limit? (Served ones are simply charged.)"""
    return is_spend_refusal(post(gw, "/v1/chat/completions", CHAT))


# The tests below are grouped by the limit they need (each gateway: every $0 test, then every
# test at a limit): a change of limit is a CLI run and a wait for the gateway to apply it.


@pytest.fixture
def at_zero(gateway: LiteLLM) -> LiteLLM:
    if WHO.limit != 0:
        set_limit(gateway.env, WHO, 0, refused=lambda: refused(gateway))
    return gateway


@pytest.fixture
def at_a_limit(gateway: LiteLLM) -> LiteLLM:
    if WHO.limit != 100:
        set_limit(gateway.env, WHO, 100, refused=lambda: refused(gateway))
    return gateway


# -- at $0: nothing reaches the provider ------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), INFERENCE_ROUTES, ids=[p for p, _ in INFERENCE_ROUTES])
def test_every_inference_route_is_refused_at_zero(
    at_zero: LiteLLM, provider: Provider, path: str, body: dict[str, Any]
) -> None:
    before = provider.count()
    answer = post(at_zero, path, body)
    assert is_spend_refusal(answer), (answer.status, answer.body[:300])
    assert provider.count() == before, "the provider was called"


@pytest.mark.parametrize("path", PATH_VARIANTS)
def test_every_spelling_of_a_route_is_refused_at_zero(
    at_zero: LiteLLM, provider: Provider, path: str
) -> None:
    before = provider.count()
    answer = post(at_zero, path, CHAT)
    assert provider.count() == before, f"{path} reached the provider: {answer.status}"
    # Refused, by spendguard or by LiteLLM (a path it does not route), never served.
    assert 400 <= answer.status < 500 or answer.status == 307, answer.status


# -- the official SDKs ------------------------------------------------------------------------


def counting(requests: list[str]) -> Callable[[Any], None]:
    def hook(request: Any) -> None:
        requests.append(str(request.url))

    return hook


def refused_fast(call: Callable[[], object], error: type[Exception]) -> Any:
    started = time.monotonic()
    with pytest.raises(error) as raised:
        call()
    assert time.monotonic() - started < 5
    return raised.value


@pytest.mark.parametrize("suffix", ["/v1", ""])
def test_openai_sdk_gets_a_rate_limit_error(
    at_zero: LiteLLM, provider: Provider, suffix: str
) -> None:
    before, sent = provider.count(), list[str]()
    client = openai.OpenAI(
        base_url=f"{at_zero.base}{suffix}",
        api_key=at_zero.master_key,
        max_retries=0,
        http_client=httpx2.Client(event_hooks={"request": [counting(sent)]}),
    )
    error = refused_fast(
        lambda: client.chat.completions.create(model=MODEL, messages=PROMPT),  # type: ignore[arg-type]
        openai.RateLimitError,
    )
    assert error.response.json()["error"]["code"] == "spend_limit_exceeded"
    assert len(sent) == 1 and provider.count() == before


def test_openai_sdk_does_not_retry_a_spend_refusal(at_zero: LiteLLM, provider: Provider) -> None:
    before, sent = provider.count(), list[str]()
    client = openai.OpenAI(  # the SDK's default: two retries of a 429, unless told not to
        base_url=f"{at_zero.base}/v1",
        api_key=at_zero.master_key,
        http_client=httpx2.Client(event_hooks={"request": [counting(sent)]}),
    )
    refused_fast(
        lambda: client.chat.completions.create(model=MODEL, messages=PROMPT),  # type: ignore[arg-type]
        openai.RateLimitError,
    )
    assert len(sent) == 1 and provider.count() == before


def test_azure_sdk_gets_a_rate_limit_error(at_zero: LiteLLM, provider: Provider) -> None:
    before, sent = provider.count(), list[str]()
    client = openai.AzureOpenAI(
        azure_endpoint=at_zero.base,
        api_version="2024-10-21",
        api_key=at_zero.master_key,  # sent as the api-key header
        max_retries=0,
        http_client=httpx2.Client(event_hooks={"request": [counting(sent)]}),
    )
    error = refused_fast(
        lambda: client.chat.completions.create(model=MODEL, messages=PROMPT),  # type: ignore[arg-type]
        openai.RateLimitError,
    )
    assert "/openai/deployments/gpt-4o-mini/chat/completions" in sent[0]
    assert error.response.json()["error"]["code"] == "spend_limit_exceeded"
    assert len(sent) == 1 and provider.count() == before


def test_anthropic_sdk_gets_a_rate_limit_error(at_zero: LiteLLM, provider: Provider) -> None:
    before, sent = provider.count(), list[str]()
    client = anthropic.Anthropic(
        base_url=at_zero.base,
        api_key=at_zero.master_key,  # sent as x-api-key
        max_retries=0,
        http_client=httpx2.Client(event_hooks={"request": [counting(sent)]}),
    )
    error = refused_fast(
        lambda: client.messages.create(model=MODEL, max_tokens=50, messages=PROMPT),  # type: ignore[arg-type]
        anthropic.RateLimitError,
    )
    assert error.response.json()["error"]["type"] == "rate_limit_error"
    assert "spend limit exceeded" in error.response.json()["error"]["message"]
    assert sent[0].endswith("/v1/messages") and len(sent) == 1 and provider.count() == before


# -- at a limit: each served inference charged once, exactly ----------------------------------

CHARGED: list[tuple[str, dict[str, Any], str]] = [
    ("/chat/completions", CHAT, MODEL),
    ("/v1/chat/completions", CHAT, MODEL),
    ("/v1/chat/completions", {**CHAT, "model": ALIAS}, MODEL),  # charged as what it routes to
    ("/openai/v1/chat/completions", CHAT, MODEL),
    ("/v1/completions", COMPLETION, MODEL),
    ("/v1/embeddings", EMBED, EMBEDDING),
    ("/v1/responses", RESPONSE, MODEL),
    ("/openai/v1/responses", RESPONSE, MODEL),
    (f"/openai/deployments/{MODEL}/chat/completions{AZURE}", NO_MODEL, MODEL),
    (f"/engines/{MODEL}/chat/completions", NO_MODEL, MODEL),
    # LiteLLM calls the path's model whatever the body says (and echoes the body's name back).
    (f"/openai/deployments/{MODEL}/chat/completions{AZURE}", {**CHAT, "model": OTHER}, MODEL),
    (f"/engines/{MODEL}/chat/completions", {**CHAT, "model": OTHER}, MODEL),
    ("/v1/messages", MESSAGE, MODEL),
    ("/queue/chat/completions", {**CHAT, "priority": 0}, MODEL),
    ("/cursor/chat/completions", CHAT, MODEL),
]


@pytest.mark.parametrize(
    ("path", "body", "model"), CHARGED, ids=[f"{p}-{b.get('model')}" for p, b, _ in CHARGED]
)
def test_each_served_inference_is_charged_once_exactly(
    at_a_limit: LiteLLM, provider: Provider, path: str, body: dict[str, Any], model: str
) -> None:
    assert_charged_once(at_a_limit, provider, path, body, model)


def assert_charged_once(
    gw: LiteLLM, provider: Provider, path: str, body: dict[str, Any], model: str
) -> None:
    """One request: served, one provider call, one charge of exactly the fake's usage at the
    price of ``model``, the model LiteLLM called (an alias's too)."""
    before = provider.count()
    answer, upstream = served_once(provider, before, lambda: post(gw, path, body))
    inference = answer.headers.get("x-spendguard-inference-id")
    assert inference, f"spendguard did not see {path}: {answer.headers}"
    charges = settled_charges(gw.database, inference)
    tokens_in, tokens_out, cost = price(model, upstream)
    assert len(charges) == 1, charges
    (charge,) = charges
    assert not charge.usage_estimated, charge
    assert (charge.model, charge.input_tokens, charge.output_tokens) == (
        model,
        tokens_in,
        tokens_out,
    )
    assert charge.amount_micros == cost > 0


# -- aliases: priced from LiteLLM's model_list, no price file --------------------------------


@pytest.fixture(params=["resolver", "depends"])
def either_at_a_limit(request: pytest.FixtureRequest, gateways: tuple[LiteLLM, LiteLLM]) -> LiteLLM:
    gw, who = (gateways[0], WHO) if request.param == "resolver" else (gateways[1], DEPENDS_WHO)
    if who.limit != 100:
        set_limit(gw.env, who, 100, refused=lambda: refused(gw))
    return gw


def served_and_settled(gw: LiteLLM, provider: Provider, body: dict[str, Any]) -> Any:
    """One chat completion of ``body``: its answer, what the provider got, its one charge."""
    answer, upstream = served_once(
        provider, provider.count(), lambda: post(gw, "/v1/chat/completions", body)
    )
    assert answer.json()["model"] == body["model"]  # LiteLLM answers with the alias
    charges = settled_charges(gw.database, answer.headers["x-spendguard-inference-id"])
    assert len(charges) == 1, charges
    assert not charges[0].usage_estimated
    return answer, upstream, charges[0]


def test_an_alias_is_charged_the_shipped_price_of_the_model_it_routes_to(
    either_at_a_limit: LiteLLM, provider: Provider
) -> None:
    _, upstream, charge = served_and_settled(either_at_a_limit, provider, {**CHAT, "model": ALIAS})
    assert upstream["body"]["model"] == MODEL  # what LiteLLM called
    usage = expected_usage(upstream["path"], upstream["body"])
    assert (charge.model, charge.input_tokens, charge.output_tokens) == (
        MODEL,
        usage.input_tokens,
        usage.output_tokens,
    )
    assert charge.amount_micros == micro_usd(usage, shipped_per_1m(MODEL)) > 0


def test_an_alias_with_model_info_prices_is_charged_them(
    either_at_a_limit: LiteLLM, provider: Provider
) -> None:
    body = {**CHAT, "model": CHEAP, "messages": [{"role": "user", "content": "x " * 400}]}
    _, upstream, charge = served_and_settled(either_at_a_limit, provider, body)
    usage = expected_usage(upstream["path"], upstream["body"])
    assert charge.model == CHEAP
    cheap, listed = micro_usd(usage, CHEAP_PER_1M), micro_usd(usage, shipped_per_1m(MODEL))
    assert charge.amount_micros == cheap < listed  # its own price, not gpt-4o-mini's


def test_an_alias_of_two_deployments_is_charged_as_the_one_that_served(
    at_a_limit: LiteLLM, provider: Provider
) -> None:
    """LiteLLM picks a deployment per request; its x-litellm-model-id names it, and that
    deployment's price is charged: gpt-4o-mini's list price, or the cheap one's own."""
    body = {**CHAT, "model": MIXED, "messages": [{"role": "user", "content": "y " * 400}]}
    served: dict[str, tuple[str, Any]] = {}
    for _ in range(40):  # until both served (LiteLLM shuffles: both within 40, but for 2^-39)
        answer, upstream = served_once(
            provider, provider.count(), lambda: post(at_a_limit, "/v1/chat/completions", body)
        )
        deployment = answer.headers["x-litellm-model-id"]
        served.setdefault(deployment, (answer.headers["x-spendguard-inference-id"], upstream))
        if len(served) == 2:
            break
    assert set(served) == set(MIXED_IDS)
    expected = {
        MIXED_IDS[0]: (MODEL, shipped_per_1m(MODEL)),
        MIXED_IDS[1]: (f"{MIXED}@{MIXED_IDS[1]}", CHEAP_PER_1M),
    }
    for deployment, (inference, upstream) in served.items():
        charges = wait_for(lambda i=inference: charges_of(at_a_limit.database, i), "a charge")
        usage = expected_usage(upstream["path"], upstream["body"])
        model, per_1m = expected[deployment]
        assert [(c.model, c.amount_micros) for c in charges] == [(model, micro_usd(usage, per_1m))]


# -- the Depends block: LiteLLM's auth first, then spendguard_guard ---------------------------

DEPENDS_GUARDED = [
    ("/v1/chat/completions", CHAT),
    ("/chat/completions", CHAT),
    ("/v1/completions", COMPLETION),
    ("/v1/embeddings", EMBED),
    ("/v1/responses", RESPONSE),
    ("/v1/responses/compact", RESPONSE),
    (f"/openai/deployments/{MODEL}/chat/completions{AZURE}", NO_MODEL),
    (f"/engines/{MODEL}/chat/completions", NO_MODEL),
    ("/v1/messages", MESSAGE),
    ("/queue/chat/completions", {**CHAT, "priority": 0}),
    ("/cursor/chat/completions", CHAT),
]


@pytest.fixture
def depends_at_zero(depends_gateway: LiteLLM) -> LiteLLM:
    if DEPENDS_WHO.limit != 0:
        set_limit(depends_gateway.env, DEPENDS_WHO, 0, refused=lambda: refused(depends_gateway))
    return depends_gateway


@pytest.fixture
def depends_at_a_limit(depends_gateway: LiteLLM) -> LiteLLM:
    if DEPENDS_WHO.limit != 100:
        set_limit(depends_gateway.env, DEPENDS_WHO, 100, refused=lambda: refused(depends_gateway))
    return depends_gateway


@pytest.mark.parametrize(
    ("path", "body", "model"),
    [
        ("/v1/chat/completions", CHAT, MODEL),
        ("/v1/messages", MESSAGE, MODEL),
        (f"/openai/deployments/{MODEL}/chat/completions{AZURE}", NO_MODEL, MODEL),
    ],
    ids=["chat", "messages", "deployment"],
)
def test_depends_a_valid_key_at_a_limit_is_served_and_charged(
    depends_at_a_limit: LiteLLM, provider: Provider, path: str, body: dict[str, Any], model: str
) -> None:
    assert_charged_once(depends_at_a_limit, provider, path, body, model)


def test_depends_a_bad_key_gets_litellms_own_error(
    depends_at_a_limit: LiteLLM, provider: Provider
) -> None:
    before = provider.count()
    answer = raw_post(
        depends_at_a_limit.port, "/v1/chat/completions", CHAT, {"authorization": "Bearer sk-no"}
    )
    assert answer.status in (400, 401), answer.status
    assert "spend" not in answer.body.decode()  # LiteLLM answered (without a DB: "No connected db")
    assert "x-spendguard-inference-id" not in answer.headers  # nothing admitted, nothing charged
    assert provider.count() == before


@pytest.mark.parametrize(("path", "body"), DEPENDS_GUARDED, ids=[p for p, _ in DEPENDS_GUARDED])
def test_depends_a_valid_key_at_zero_is_refused(
    depends_at_zero: LiteLLM, provider: Provider, path: str, body: dict[str, Any]
) -> None:
    before = provider.count()
    answer = post(depends_at_zero, path, body)
    assert is_spend_refusal(answer), (answer.status, answer.body[:300])
    assert provider.count() == before, "the provider was called"


@pytest.mark.parametrize(
    "path", ["/openai/v1/chat/completions", "/openai/v1/responses", *PATH_VARIANTS]
)
def test_depends_what_the_guard_does_not_cover_still_never_reaches_the_provider(
    depends_at_zero: LiteLLM, provider: Provider, path: str
) -> None:
    # LiteLLM's pass-through routes list no spendguard_guard: the middleware checks them itself,
    # finds no identity (the key is LiteLLM's to check) and answers 401. Nothing is unlimited.
    body = RESPONSE if path.endswith("/responses") else CHAT
    before = provider.count()
    answer = post(depends_at_zero, path, body)
    assert provider.count() == before, f"{path} reached the provider: {answer.status}"
    assert 400 <= answer.status < 500 or answer.status == 307, answer.status
