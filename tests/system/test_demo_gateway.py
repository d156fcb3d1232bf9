"""The demo gateway as a user runs it: uvicorn, the `spendguard` CLI, the official SDKs.

This is the acceptance path of the README: a real server process on loopback, SQLite, the
embedded store, and the CLI as a separate process sharing only the database.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from spendguard.engine.pricing import PriceTable
from spendguard.testing import expected_usage
from tests.support import clean_env, run_cli, serve_demo


def key_day_message() -> str:
    """The $0 daily limit's message: it names the limit and the next UTC midnight."""
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    resets = (midnight + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"API Key daily spend limit exceeded: limit $0.00, resets at {resets}."


def key_day() -> dict[str, Any]:
    return {
        "error": {
            "type": "insufficient_quota",
            "code": "spend_limit_exceeded",
            "message": key_day_message(),
        }
    }


ALPHA_DAY = ("--team", "acme", "--api-key", "alpha", "--period", "day")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'demo.db'}",
        SPENDGUARD_SETTLE_INTERVAL="0.3",
    )


@pytest.fixture
def gateway(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    log = tmp_path / "gateway.log"
    yield from serve_demo(env, log)
    # Graceful shutdown ran the middleware's lifespan to the end (records flushed).
    assert "Application shutdown complete" in log.read_text()


@pytest.mark.timeout(300)
def test_demo_gateway_acceptance(gateway: str, env: dict[str, str]) -> None:
    run_cli(env, "policy", "set", *ALPHA_DAY, "--limit-usd", "0")
    alpha = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-demo-alpha", max_retries=0)
    beta = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-demo-beta", max_retries=0)
    messages = [{"role": "user", "content": "Say something about budgets."}]

    with pytest.raises(openai.RateLimitError) as denied:
        alpha.chat.completions.create(model="gpt-4o-mini", messages=messages)  # type: ignore[arg-type]
    assert denied.value.response.json() == key_day()
    assert int(denied.value.response.headers["retry-after"]) > 0

    expected = 0
    prices = PriceTable.load()

    def cost(path: str, body: dict[str, Any]) -> int:
        charge = prices.cost(body["model"], expected_usage(path, body))
        assert charge is not None
        return int(charge)

    # Non-streaming, streaming with and without include_usage, Responses, embeddings.
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": messages}
    reply = beta.chat.completions.create(**body)
    assert reply.usage is not None and reply.choices[0].message.content
    expected += cost("/v1/chat/completions", body)

    body = {"model": "gpt-4o-mini", "messages": messages, "stream_options": {"include_usage": True}}
    chunks = list(beta.chat.completions.create(stream=True, **body))
    assert chunks[-1].usage is not None
    expected += cost("/v1/chat/completions", {**body, "stream": True})

    body = {"model": "gpt-4.1-nano", "input": "Write one word."}
    assert beta.responses.create(**body).usage is not None
    expected += cost("/v1/responses", body)

    body = {"model": "text-embedding-3-small", "input": "budget"}
    assert beta.embeddings.create(**body).data
    expected += cost("/v1/embeddings", body)

    # Anthropic SDK through the gateway's Anthropic route, JSON and SSE.
    claude = anthropic.Anthropic(
        base_url=f"{gateway}/anthropic", api_key="sk-demo-beta", max_retries=0
    )
    body = {"model": "claude-sonnet-4-6", "max_tokens": 64, "messages": messages}
    assert claude.messages.create(**body).usage.output_tokens > 0
    expected += cost("/v1/messages", body)
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens > 0
    expected += cost("/v1/messages", {**body, "stream": True})

    with pytest.raises(anthropic.RateLimitError) as denied_claude:
        anthropic.Anthropic(
            base_url=f"{gateway}/anthropic", api_key="sk-demo-alpha", max_retries=0
        ).messages.create(**body)
    assert denied_claude.value.response.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": key_day_message()},
    }

    # Streaming without usage is estimated, so it is kept out of the exact sum above.
    list(beta.chat.completions.create(model="gpt-4o-mini", messages=messages, stream=True))  # type: ignore[call-overload]

    # Records reach the ledger a moment after the responses; settle until all are in.
    deadline = time.monotonic() + 20
    while True:
        run_cli(env, "settle")
        usage = run_cli(env, "usage", "--team", "acme")
        if usage["unsettled_records"] == 0 and usage["charges_total_micros"] > expected:
            break
        assert time.monotonic() < deadline, usage
        time.sleep(0.2)
    team_month = next(s for s in usage["limits"] if s["scope"] == "team" and s["period"] == "month")
    assert team_month["settled_micros"] == usage["charges_total_micros"]
    estimated = usage["charges_total_micros"] - expected
    assert 0 < estimated < 100  # the one usage-less stream: a few tokens of gpt-4o-mini
    alpha_day = next(s for s in usage["limits"] if s["api_key"] == "alpha" and s["period"] == "day")
    assert alpha_day["limit_micros"] == 0 and alpha_day["settled_micros"] == 0
