"""The IETF rate-limit fields (draft-ietf-httpapi-ratelimit-headers-11): ``RateLimit-Policy``
and ``RateLimit`` for the caller's own API key, its spend limits and its rates, from the
preflight's values, on the provider's answer and on spendguard's 429; off by default; never a
team's limit, a balance or another key's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import openai
import pytest

from spendguard.asgi.ratelimit import ratelimit_fields
from spendguard.clock import to_millis
from spendguard.engine.decision import Decision, Verdict
from spendguard.identity import Identity
from spendguard.limits import Balance, KeyCodec, Period, Target, key_limit, team_limit
from spendguard.limits.model import SubjectKind
from spendguard.limits.rates import Rates, RateState
from spendguard.store import LimitState
from tests.support import Gateway
from tests.support.budgets import BudgetGateway, section
from tests.support.gateway import chat_body

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
BETA = Identity("acme", "beta")
T0 = datetime(2026, 9, 30, 12, tzinfo=UTC)  # 12 h before both the day and the month reset
CODEC = KeyCodec("quota", timedelta(days=2))
SEPTEMBER = 30 * 86_400


def state(target: Target, limit: int, used: int) -> LimitState:
    return LimitState(CODEC.check(target, T0), limit, used)


def rates(scope: SubjectKind, **counts: int) -> RateState:
    values = {"prev_requests": 0, "requests": 0, "prev_tokens": 0, "tokens": 0, "in_flight": 0}
    values.update(counts)
    return RateState(
        scope, Rates(rpm=60, tpm=10_000, max_parallel=4), now_ms=to_millis(T0) + 15_000, **values
    )


def decision(*limits: LimitState, rated: tuple[RateState, ...] = ()) -> Decision:
    return Decision(Verdict.ALLOW, ALPHA, T0, "r1", "r1", limits=limits, rates=rated)


def test_the_callers_key_limits_and_rates_as_policies_and_what_is_left() -> None:
    fields = ratelimit_fields(
        decision(
            state(key_limit(ALPHA, Period.DAY), 5_000_000, 1_782_600),
            state(key_limit(ALPHA, Period.MONTH), 20_000_000, 21_000_000),  # over: 0 left
            state(key_limit(BETA, Period.DAY), 1, 0),  # another key's: never told
            state(team_limit(ALPHA, Period.DAY), 9, 1),  # the team's: shared, never told
            state(Balance("acme"), 9, 1),
            rated=(rates(SubjectKind.API_KEY, requests=3, tokens=1_200, in_flight=1),),
        )
    )
    assert fields == [
        (
            b"ratelimit-policy",
            b'"key-usd-day";q=5000000;qu="spendguard-usd-micros";w=86400, '
            b'"key-usd-month";q=20000000;qu="spendguard-usd-micros";w='
            + str(SEPTEMBER).encode()
            + b', "key-rpm";q=60;w=60, "key-tpm";q=10000;qu="spendguard-tokens";w=60, '
            b'"key-parallel";q=4;qu="concurrent-requests"',
        ),
        (
            b"ratelimit",
            b'"key-usd-day";r=3217400;t=43200, "key-usd-month";r=0;t=43200, '
            # this minute's requests count until the next one ends: 45 s + 60 s
            b'"key-rpm";r=57;t=105, "key-tpm";r=8800;t=105, "key-parallel";r=3',
        ),
    ]


def test_a_teams_rates_and_no_key_limit_give_no_fields() -> None:
    assert ratelimit_fields(decision(state(team_limit(ALPHA, Period.DAY), 9, 1))) == []
    assert ratelimit_fields(decision(rated=(rates(SubjectKind.TEAM, requests=1),))) == []
    assert ratelimit_fields(None) == []


async def test_the_gateway_sends_the_fields_when_asked(tmp_path: Path) -> None:
    async with Gateway(tmp_path, ratelimit_headers=True) as gw:
        await gw.policy(Period.DAY, 30)  # two requests of 15 micro-USD
        await gw.policy(Period.MONTH, 1_000, key=None)  # the team's: not told
        await gw.guard.admin.set_rates("acme", "alpha", rpm=100)
        await gw.guard.admin.set_rates("acme", None, rpm=1_000)  # the team's: not told
        first, second, denied = await gw.post(), await gw.post(), await gw.post()
    assert first.status_code == second.status_code == 200 and denied.status_code == 429
    policy = '"key-usd-day";q=30;qu="spendguard-usd-micros";w=86400, "key-rpm";q=100;w=60'
    for response in (first, second):
        assert response.headers["ratelimit-policy"] == policy
    assert first.headers["ratelimit"] == '"key-usd-day";r=30;t=43200, "key-rpm";r=99;t=120'
    assert second.headers["ratelimit"] == '"key-usd-day";r=15;t=43200, "key-rpm";r=98;t=120'
    # The refusal tells the limit that refused: nothing left of the day, the Retry-After no
    # earlier than its reset (a spend limit's denial counts no rate: none is told).
    assert denied.headers["ratelimit-policy"] == policy.split(", ")[0]
    assert denied.headers["ratelimit"] == '"key-usd-day";r=0;t=43200'
    assert int(denied.headers["retry-after"]) >= 43_200


async def test_a_rates_429_tells_the_rate(tmp_path: Path) -> None:
    async with Gateway(tmp_path, ratelimit_headers=True) as gw:
        await gw.guard.admin.set_rates("acme", "alpha", rpm=1)
        ok, limited = await gw.post(), await gw.post()
    assert ok.status_code == 200 and limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert limited.headers["ratelimit-policy"] == '"key-rpm";q=1;w=60'
    assert limited.headers["ratelimit"] == '"key-rpm";r=0;t=120'
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"


async def test_the_openai_sdk_reads_them_beside_its_own(tmp_path: Path) -> None:
    async with Gateway(tmp_path, ratelimit_headers=True, remaining_headers=True) as gw:
        await gw.policy(Period.DAY, 1_000)
        await gw.guard.admin.set_rates("acme", "alpha", rpm=100, tpm=50_000)
        async with gw.client() as http:
            sdk = openai.AsyncOpenAI(
                api_key="sk-test", base_url="http://gw/v1", http_client=http, max_retries=0
            )
            raw = await sdk.chat.completions.with_raw_response.create(
                model="unit-model", messages=[{"role": "user", "content": "hi"}]
            )
    assert raw.http_response.status_code == 200
    headers = raw.headers
    assert '"key-tpm";q=50000;qu="spendguard-tokens";w=60' in headers["ratelimit-policy"]
    assert headers["x-ratelimit-limit-requests"] == "100"  # OpenAI's own, unchanged
    assert headers["x-spendguard-remaining-usd-day"] == "0.001000"  # and spendguard's


async def test_the_fields_are_off_by_default(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await gw.policy(Period.DAY, 15)
        await gw.guard.admin.set_rates("acme", "alpha", rpm=100)
        ok, denied = await gw.post(), await gw.post()
    assert ok.status_code == 200 and denied.status_code == 429
    for response in (ok, denied):
        assert "ratelimit" not in response.headers and "ratelimit-policy" not in response.headers


async def test_the_keys_own_token_budget_is_told_in_fields_of_its_own(tmp_path: Path) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1_000}, "global": {"tokens": 10**6}})
    gw = BudgetGateway(tmp_path, budgets=budgets, ratelimit_headers=True)
    async with gw, gw.client() as c:
        await gw.policy(Period.DAY, 1_000)
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))
    assert r.status_code == 200
    policies = r.headers.get_list("ratelimit-policy")
    states = r.headers.get_list("ratelimit")
    # The spend limit's field and the budget's, one line each (one list split over two).
    assert policies == [
        '"key-usd-day";q=1000;qu="spendguard-usd-micros";w=86400',
        '"key-tokens-hourly";q=1000;qu="spendguard-tokens";w=3600, '
        '"key-tokens-daily";q=1000;qu="spendguard-tokens";w=86400',
    ]
    # Left after this request's hold of 100 tokens; the windows empty a slice after it.
    assert states[1].startswith('"key-tokens-hourly";r=900;t=')
    assert '"key-tokens-daily";r=900;t=' in states[1]
    assert "global" not in r.headers["ratelimit-policy"]  # shared: never told
