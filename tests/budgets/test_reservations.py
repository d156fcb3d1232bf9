"""What a token budget reserves, and which refusal a request gets when it can't be admitted.

A request reserves its prompt estimate plus the output the spend limits reserve too: its
``max_tokens`` capped at the model's maximum output, or the default output reservation
(``SPENDGUARD_DEFAULT_OUTPUT_TOKENS``, per model ``..._BY_MODEL``, or the section's own
``default_output_tokens``). The chat prompt "hi" is estimated at 2 tokens.

A request whose reservation alone exceeds a budget's whole limit never fits: a distinct 429
with ``x-should-retry: false`` and no ``Retry-After``. When the spend limits refuse too, the
answer names the refusal that lasts longest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import REGISTRY
from starlette.types import ASGIApp, Receive, Scope, Send

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi.request import parse_request
from spendguard.engine.budgets import gate_for
from spendguard.engine.entries import admission_tokens
from spendguard.identity import Identity
from spendguard.limits import Period
from spendguard.store.memory import MemoryStore
from tests.support import UNIT_PRICES, Clock, Counting, StateAuth, chat_body, client, upstream
from tests.support.budgets import BudgetGateway, section

pytestmark = pytest.mark.anyio

PROMPT = 2  # the budget's estimate of the prompt "hi"
BUDGET = 2000


def key_budget(tokens: int = BUDGET, **extra: Any) -> dict[str, Any]:
    return section(scopes={"per_api_key": {"tokens": tokens}}, **extra)


def remaining(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.headers["x-budget-api-key-remaining"])


async def held(gw: BudgetGateway, window: str = "hourly") -> int:
    """What the key's budget counts in ``window``: usage and holds."""
    report = await gw.budgets.inspect()
    counted = {(c.scope.value, c.subject, c.window): c.tokens for c in report.counters}
    return counted["per_api_key", "acme:alpha", window]


# -- the request that never fits ---------------------------------------------------------------
async def test_a_request_without_max_tokens_is_told_it_never_fits_and_to_set_it(
    tmp_path: Path,
) -> None:
    async with BudgetGateway(tmp_path, budgets=key_budget()) as gw, gw.client() as c:
        denied = await c.post("/v1/chat/completions", json=chat_body())
        assert await held(gw) == 0  # nothing of it stays reserved
        # The advice is right: the largest max_tokens it names fits exactly.
        fits = await c.post("/v1/chat/completions", json=chat_body(max_tokens=1998))
        assert remaining(fits) == 0
    assert denied.status_code == 429
    assert denied.json() == {
        "error": {
            "type": "request_exceeds_budget",
            "code": "request_exceeds_budget",
            "message": "This request can never pass the API key token budget of 2,000 tokens "
            "for window 'hourly' as sent: it reserves 4,098 tokens: 2 input and 4,096 output "
            "tokens (it sets no max_tokens, so the default output reservation applies). Set "
            "max_tokens to at most 1,998.",
            "details": {
                "scope": "per_api_key",
                "window": "hourly",
                "unit": "tokens",
                "limit": BUDGET,
                "reserved": 4098,
            },
        }
    }
    # Waiting never helps: no Retry-After, and the SDKs are told not to retry.
    assert denied.headers["x-should-retry"] == "false"
    assert "retry-after" not in denied.headers


async def test_a_declared_max_tokens_too_large_is_told_to_lower_it(tmp_path: Path) -> None:
    budgets = section(scopes={"per_model": {"unit-model": {"cost_usd": 0.001}}})
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        openai_style = await c.post("/v1/chat/completions", json=chat_body(max_tokens=3000))
        anthropic_style = await c.post("/v1/messages", json=chat_body(max_tokens=3000))
    message = (
        "This request can never pass the Model 'unit-model' cost budget of $0.001 for window "
        "'hourly' as sent: it reserves $0.003002: 2 input and 3,000 output tokens (its "
        "max_tokens). Lower max_tokens to at most 998."
    )
    details = {
        "scope": "per_model",
        "window": "hourly",
        "unit": "cost_micro_usd",
        "limit_micro_usd": 1000,
        "model": "unit-model",
        "reserved_micro_usd": 3002,
    }
    assert openai_style.json()["error"] == {
        "type": "request_exceeds_budget",
        "code": "request_exceeds_budget",
        "message": message,
        "details": details,
    }
    # Anthropic's envelope has no code: its type says the request itself must change.
    assert anthropic_style.status_code == 429
    assert anthropic_style.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message, "details": details},
    }
    for denied in (openai_style, anthropic_style):
        assert denied.headers["x-should-retry"] == "false"
        assert "retry-after" not in denied.headers


class CountRequests:
    def __init__(self, app: ASGIApp) -> None:
        self.app, self.seen = app, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen += scope["type"] == "http"
        await self.app(scope, receive, send)


async def test_the_openai_sdk_raises_at_once_without_retrying(tmp_path: Path) -> None:
    async with BudgetGateway(tmp_path, budgets=key_budget()) as gw:
        app = CountRequests(gw.app)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        # The SDK's own retries on: a 429 it may retry would be sent three times.
        async with openai.AsyncOpenAI(
            base_url="http://gw/v1", api_key="x", max_retries=2, http_client=http
        ) as sdk:
            with pytest.raises(openai.RateLimitError) as caught:
                await sdk.chat.completions.create(
                    model="unit-model", messages=[{"role": "user", "content": "hi"}]
                )
    assert app.seen == 1
    err = caught.value
    assert err.code == "request_exceeds_budget" and err.type == "request_exceeds_budget"
    assert "Set max_tokens to at most 1,998." in err.message
    assert isinstance(err.body, dict) and err.body["details"]["reserved"] == 4098


# -- what is reserved ---------------------------------------------------------------------------
async def test_the_default_output_reservation_is_a_setting(tmp_path: Path) -> None:
    async with (
        BudgetGateway(tmp_path, budgets=key_budget(), default_output_tokens=1000) as gw,
        gw.client() as c,
    ):
        ok = await c.post("/v1/chat/completions", json=chat_body())
    assert remaining(ok) == BUDGET - PROMPT - 1000


async def test_the_budgets_section_keeps_its_own_default(tmp_path: Path) -> None:
    budgets = key_budget(default_output_tokens=300)
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        ok = await c.post("/v1/chat/completions", json=chat_body())
    assert remaining(ok) == BUDGET - PROMPT - 300


def gateway(tmp_path: Path, **settings: Any) -> tuple[SpendGuard, ASGIApp]:
    """A guard and its middleware with budgets, on a price table where ``short-model`` can
    write at most 100 tokens and ``unit-model`` has no known maximum."""
    table = json.loads(json.dumps(UNIT_PRICES))
    table["models"]["short-model"] = {"input": "1", "output": "1", "max_output_tokens": 100}
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(table))
    guard = SpendGuard(
        Settings(
            database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
            prices=prices,
            budgets=key_budget(),
            run_worker=False,
            **settings,
        ),
        store=Counting(MemoryStore(clock=Clock())),
        clock=Clock(),
    )
    return guard, StateAuth(SpendGuardMiddleware(upstream(), guard=guard))


async def test_a_declared_max_tokens_above_the_models_maximum_is_capped(tmp_path: Path) -> None:
    guard, app = gateway(tmp_path)
    async with client(app) as c:
        capped = await c.post("/v1/chat/completions", json=chat_body(model="short-model"))
        declared = await c.post(
            "/v1/chat/completions", json=chat_body(model="short-model", max_tokens=50_000)
        )
    # Without a cap, and with one the model could never reach: its 100 tokens, not 4,096 or
    # 50,000 (the first request's 15 used replaced its reservation).
    assert remaining(capped) == BUDGET - PROMPT - 100
    assert remaining(declared) == BUDGET - 15 - PROMPT - 100
    await guard.stop()


async def test_a_per_model_default_output_reservation(tmp_path: Path) -> None:
    guard, app = gateway(tmp_path, default_output_tokens_by_model={"Unit-Model": 500})
    async with client(app) as c:
        own = await c.post("/v1/chat/completions", json=chat_body())
        # A dated snapshot the price table prices as its family gets the family's default.
        snapshot = await c.post("/v1/chat/completions", json=chat_body(model="unit-model-20260101"))
        # Another model keeps the default, capped at its maximum.
        other = await c.post("/v1/chat/completions", json=chat_body(model="short-model"))
    assert remaining(own) == BUDGET - PROMPT - 500
    assert remaining(snapshot) == BUDGET - 15 - PROMPT - 500
    assert remaining(other) == BUDGET - 30 - PROMPT - 100
    await guard.stop()


@pytest.mark.parametrize(
    "body, output",
    [
        (chat_body(model="short-model"), 100),  # the default, capped at the model's maximum
        (chat_body(model="short-model", max_tokens=5000), 100),  # declared, capped
        (chat_body(model="short-model", max_tokens=60, n=3), 180),  # each of 3 completions
        (chat_body(model="unit-model-20260101"), 700),  # a per-model default, by its entry
        (chat_body(model="unpriced-model"), 4096),  # the default: no maximum known
    ],
)
async def test_spend_limits_and_budgets_reserve_the_same_output(
    tmp_path: Path, body: dict[str, Any], output: int
) -> None:
    guard, _ = gateway(tmp_path, default_output_tokens_by_model={"unit-model": 700})
    gate = gate_for(guard)
    assert gate is not None
    request = parse_request(json.dumps(body).encode())
    assert admission_tokens(request, guard.coster.table, guard.output)[1] == output
    budget = await gate.admit(Identity("acme", "alpha"), request)
    assert budget is not None and budget.hold is not None
    assert budget.hold.tokens == request.estimated_input_tokens + output
    await gate.release(budget)
    await guard.stop()


# -- several refusals: the longest is named -----------------------------------------------------
@pytest.mark.parametrize(
    "body, before",
    [
        (chat_body(), 0),  # the budget: never fits as sent (lower max_tokens)
        (chat_body(max_tokens=1990), 1),  # the budget: exceeded for 24 hours (15 used)
    ],
)
async def test_a_zero_spend_limit_is_named_before_any_budget_refusal(
    tmp_path: Path, body: dict[str, Any], before: int
) -> None:
    # The day's $0 limit resets in 12 hours, to $0 again: it outlasts both budget refusals.
    budgets = key_budget(windows=[{"id": "daily", "period": "24h"}])
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        for _ in range(before):
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        await gw.policy(Period.DAY, 0)
        denied = await c.post("/v1/chat/completions", json=body)
        assert await held(gw, "daily") == (15 if before else 0)  # nothing of it is held
    assert denied.status_code == 429
    assert denied.json()["error"] == {
        "type": "insufficient_quota",
        "code": "spend_limit_exceeded",
        "message": "API Key daily spend limit exceeded: limit $0.00, resets at "
        "2026-10-01T00:00:00Z.",
    }
    assert denied.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("window, named", [("1h", "spend limit"), ("24h", "budget")])
async def test_of_two_waits_the_longer_is_named(tmp_path: Path, window: str, named: str) -> None:
    budgets = key_budget(1000, windows=[{"id": "w", "period": window}])
    async with BudgetGateway(tmp_path, budgets=budgets) as gw, gw.client() as c:
        await gw.policy(Period.DAY, 1)  # one micro-USD: the first request's 15 use it up
        assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=10))).is_success
        # 15 used: both refuse now; the day's spend limit resets in 12 hours, the budget
        # drains the first request's 15 tokens after its window.
        denied = await c.post("/v1/chat/completions", json=chat_body(max_tokens=990))
    assert denied.status_code == 429
    if named == "spend limit":
        assert denied.json()["error"]["code"] == "spend_limit_exceeded"
        assert denied.headers["retry-after"] == str(12 * 3600)
    else:
        assert denied.json()["error"]["code"] == "budget_exceeded"
        assert denied.headers["retry-after"] == str(24 * 3600)


def allowed_decisions() -> float:
    labels = {"outcome": "allowed", "kind": "limited", "period": "none"}
    return REGISTRY.get_sample_value("spendguard_decisions_total", labels) or 0.0


async def test_asking_the_spend_limits_leaves_nothing_behind(tmp_path: Path) -> None:
    async with BudgetGateway(tmp_path, budgets=key_budget()) as gw, gw.client() as c:
        await gw.guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1, hard=True)
        await gw.guard.admin.set_rates("acme", "alpha", rpm=1)
        usage_key = next(
            check.usage_key
            for check in gw.guard.codec.plan(Identity("acme", "alpha"), gw.clock()).checks
        )
        for _ in range(2):  # the first fills the cache
            calls = dict(gw.store.calls)
            allowed = allowed_decisions()
            denied = await c.post("/v1/chat/completions", json=chat_body())
            assert denied.json()["error"]["code"] == "request_exceeds_budget"
        # The spend limits were asked (they admit it) and their hold returned at once; their
        # answer is no admission in the decisions metric.
        assert gw.store.calls["preflight"] - calls["preflight"] == 1
        assert gw.store.calls["postflight"] - calls["postflight"] == 1
        assert allowed_decisions() == allowed
        parts = (await gw.store.read_parts([usage_key]))[usage_key]
        assert parts is not None and (parts.held, parts.pending) == (0, 0)
        # Nor was it counted in the key's rate of one request a minute: the next one passes.
        calls = dict(gw.store.calls)
        ok = await c.post("/v1/chat/completions", json=chat_body(max_tokens=100))
        assert ok.status_code == 200, ok.text
        # An admitted request asks the store once before the provider is called, as ever.
        assert gw.store.calls["preflight"] - calls["preflight"] == 1
        assert gw.postflights == 1
        await gw.guard.recorder.flush()
        assert await gw.guard.ledger.unsettled() == (1, 15)  # the one record: the admitted
