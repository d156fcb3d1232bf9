"""End to end through the official SDKs, against the fake provider: the key's budget headers on
an admitted call, then the 429 with ``details`` and ``Retry-After`` as each SDK surfaces it."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from spendguard.testing import fake_upstream
from tests.support import UNIT_MODEL
from tests.support.budgets import BudgetGateway, section
from tests.testing.wire import anthropic_client, openai_client

pytestmark = pytest.mark.anyio

LIMIT = 400


def gateway(tmp_path: Path) -> BudgetGateway:
    budgets = section(scopes={"per_api_key": {"tokens": LIMIT}})
    return BudgetGateway(tmp_path, budgets=budgets, app=fake_upstream())


async def test_openai_sdk_sees_headers_then_budget_exceeded(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, openai_client(gw.app) as client:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "hi"}
        ]
        raw = await client.chat.completions.with_raw_response.create(
            model=UNIT_MODEL, messages=messages, max_tokens=100
        )
        assert raw.parse().usage is not None
        assert raw.headers["x-budget-api-key-limit"] == str(LIMIT)
        remaining = int(raw.headers["x-budget-api-key-remaining"])
        assert 0 < remaining < LIMIT - 100
        assert int(raw.headers["x-budget-api-key-reset"]) > 0
        with pytest.raises(openai.RateLimitError) as caught:
            # A hold of the whole limit (its prompt's estimate, the rest output) would fit an
            # empty window, but the first request's usage is in it.
            prompt = LIMIT - 100 - remaining
            await client.chat.completions.create(
                model=UNIT_MODEL, messages=messages, max_tokens=LIMIT - prompt
            )
    err = caught.value
    assert err.code == "budget_exceeded" and err.type == "budget_exceeded"
    assert isinstance(err.body, dict)
    assert err.body["details"] == {
        "scope": "per_api_key",
        "window": "hourly",
        "unit": "tokens",
        "limit": LIMIT,
    }
    assert int(err.response.headers["retry-after"]) > 0


async def test_anthropic_sdk_sees_headers_then_rate_limit_error(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, anthropic_client(gw.app) as client:
        raw = await client.messages.with_raw_response.create(
            model=UNIT_MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        )
        assert (await raw.parse()).usage.output_tokens > 0
        assert raw.headers["x-budget-api-key-limit"] == str(LIMIT)
        remaining = int(raw.headers["x-budget-api-key-remaining"])
        assert remaining < LIMIT - 100
        with pytest.raises(anthropic.RateLimitError) as caught:
            await client.messages.create(  # a hold of the whole limit, as above
                model=UNIT_MODEL,
                max_tokens=remaining + 100,
                messages=[{"role": "user", "content": "hi"}],
            )
    err = caught.value
    assert isinstance(err.body, dict)
    assert err.body["error"]["type"] == "rate_limit_error"
    assert err.body["error"]["details"]["scope"] == "per_api_key"
    assert err.body["error"]["details"]["limit"] == LIMIT
    assert int(err.response.headers["retry-after"]) > 0
