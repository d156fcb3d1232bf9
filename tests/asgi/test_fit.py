"""Fit instead of refuse: a request a hard spend limit would refuse as sent goes on with its
output cap lowered to what the limit has left, when that is at least the configured minimum;
the body the provider gets differs from the client's in the cap's digits only, and the answer
says what it was fitted to. Off by default; below the minimum it is refused as before."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from prometheus_client import REGISTRY

from spendguard import SpendGuardMiddleware
from spendguard.asgi.fit import FIT_HEADER
from spendguard.limits import Period
from spendguard.testing import fake_upstream
from tests.support import Gateway, StateAuth
from tests.support.budgets import BudgetGateway, section
from tests.support.gateway import MODEL

pytestmark = pytest.mark.anyio

FITTED = FIT_HEADER.decode()
LIMIT = 1_040  # micro-USD: at 1 per token, about 1,000 output tokens besides the prompt
ASKED = 4_000


async def hard_day_limit(gw: Gateway, micros: int) -> None:
    """The key's hard daily limit, in front of the fake provider (it answers at most the
    output its request's cap allows, as a provider does)."""
    gw.inner = fake_upstream()
    gw.app = StateAuth(SpendGuardMiddleware(gw.inner, guard=gw.guard))
    await gw.guard.admin.set_policy(
        "acme", "alpha", window=Period.DAY, limit_usd=Decimal(micros) / 10**6, hard=True
    )


def sdk(http: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key="sk-test", base_url="http://gw/v1", http_client=http, max_retries=0
    )


MESSAGES: Any = [{"role": "user", "content": "hi"}]
LONG = {"x-fake-chunks": "5000"}  # the provider would answer far more than fits


def fitted_total() -> float:
    return REGISTRY.get_sample_value("spendguard_fitted_total") or 0.0


async def test_the_openai_sdk_gets_an_answer_capped_at_what_fits(tmp_path: Path) -> None:
    before = fitted_total()
    async with Gateway(tmp_path, fit_min_output_tokens=100) as gw:
        await hard_day_limit(gw, LIMIT)
        async with gw.client() as http:
            raw = await sdk(http).chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=ASKED, extra_headers=LONG
            )
        fitted = int(raw.headers[FITTED])
        completion = raw.parse()
        [sent] = [json.loads(r.body) for r in gw.inner.received]
        await gw.settle()
        charged = await gw.guard.ledger.charges_total()
    assert 900 < fitted < LIMIT  # what the limit leaves beside the prompt's estimate
    assert sent["max_tokens"] == fitted  # the provider was asked for no more
    assert completion.usage is not None and completion.usage.completion_tokens == fitted
    assert completion.choices[0].finish_reason == "length"
    assert charged <= LIMIT
    assert fitted_total() == before + 1


async def test_a_stream_through_the_sdk_is_fitted_too(tmp_path: Path) -> None:
    async with Gateway(tmp_path, fit_min_output_tokens=100) as gw:
        await hard_day_limit(gw, LIMIT)
        async with gw.client() as http:
            raw = await sdk(http).chat.completions.with_raw_response.create(
                model=MODEL,
                messages=MESSAGES,
                max_completion_tokens=ASKED,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=LONG,
            )
            fitted = int(raw.headers[FITTED])
            words = usage = 0
            async for chunk in raw.parse():
                words += sum(1 for c in chunk.choices if c.delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
        await gw.settle()
        charged = await gw.guard.ledger.charges_total()
    assert 900 < fitted < LIMIT
    assert words == usage == fitted
    assert charged <= LIMIT


async def test_the_bytes_forwarded_differ_in_the_caps_digits_only(tmp_path: Path) -> None:
    body = (
        b'{"model": "' + MODEL.encode() + b'", "x_vendor": {"max_tokens": 9},\n'
        b' "messages": [{"role": "user", "content": "caf\\u00e9"}], "max_tokens": 4000, '
        b'"temperature": 1.0E0}'
    )
    async with Gateway(tmp_path, fit_min_output_tokens=100) as gw:
        await hard_day_limit(gw, LIMIT)
        async with gw.client() as http:
            r = await http.post(
                "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json", **LONG},
            )
        [received] = gw.inner.received
    assert r.status_code == 200
    fitted = r.headers[FITTED].encode()
    assert received.body == body.replace(b'"max_tokens": 4000', b'"max_tokens": ' + fitted)
    assert received.headers["content-length"] == str(len(received.body))


async def test_below_the_minimum_it_is_refused_as_sent(tmp_path: Path) -> None:
    async with Gateway(tmp_path, fit_min_output_tokens=2_000) as gw:
        await hard_day_limit(gw, LIMIT)
        r = await gw.post(max_tokens=ASKED)
        assert not gw.inner.received
    assert r.status_code == 429 and FITTED not in r.headers


async def test_off_by_default(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await hard_day_limit(gw, LIMIT)
        r = await gw.post(max_tokens=ASKED)
    assert r.status_code == 429 and FITTED not in r.headers


async def test_200_at_once_never_spend_past_the_hard_limit(tmp_path: Path) -> None:
    limit = 20_000
    statuses: list[int] = []
    fitted: list[int] = []
    async with Gateway(tmp_path, fit_min_output_tokens=50) as gw:
        await hard_day_limit(gw, limit)
        async with gw.client() as http:

            async def one() -> None:
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": ASKED},
                    headers=LONG,
                )
                statuses.append(r.status_code)
                if FITTED in r.headers:
                    fitted.append(int(r.headers[FITTED]))

            async with anyio.create_task_group() as tg:
                for _ in range(200):
                    tg.start_soon(one)
        await gw.settle()
        charged = await gw.guard.ledger.charges_total()
    # Four answers of 4,000 tokens fit as sent; then the rest of the limit goes to fitted ones.
    assert set(statuses) <= {200, 429} and statuses.count(200) == 4 + len(fitted)
    assert fitted and all(50 <= f < ASKED for f in fitted)
    assert limit - 1_000 < charged <= limit


async def test_a_token_budget_fits_the_request_too(tmp_path: Path) -> None:
    """A rolling budget's refusal is fitted like a hard limit's: the cap what the tightest
    window has left beside the prompt; the budget then counts what the answer used."""
    budgets = section(scopes={"per_api_key": {"tokens": 1_000}})
    gw = BudgetGateway(tmp_path, budgets=budgets, app=fake_upstream(), fit_min_output_tokens=100)
    async with gw, gw.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": ASKED},
            headers=LONG,
        )
        fitted = int(r.headers[FITTED])
        [sent] = [json.loads(x.body) for x in gw.inner.received]
        counters = [c.tokens for c in (await gw.budgets.inspect()).counters]
    assert r.status_code == 200 and 900 < fitted < 1_000
    assert sent["max_tokens"] == fitted
    assert r.json()["usage"]["completion_tokens"] == fitted
    assert counters and all(used <= 1_000 for used in counters)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_with_fitting_opt_in_only_the_hard_limits_that_say_fit_are_fitted(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    """SPENDGUARD_FIT_BY_DEFAULT=false: the key whose hard limit says fit gets a fitted
    answer, the key whose hard limit doesn't is refused as sent (the flag travels through
    the ledger and the store's policy cache, on the embedded store and on Redis)."""
    settings: dict[str, Any] = {"fit_min_output_tokens": 100, "fit_by_default": False}
    if store == "redis":
        settings |= {"redis_url": request.getfixturevalue("redis_url")}
    async with Gateway(tmp_path, **settings) as gw:
        gw.inner = fake_upstream()
        gw.app = StateAuth(SpendGuardMiddleware(gw.inner, guard=gw.guard))
        for key, fit in (("alpha", True), ("beta", False)):
            saved = await gw.guard.admin.set_policy(
                "acme", key, window=Period.DAY, limit_usd=Decimal(LIMIT) / 10**6, hard=True, fit=fit
            )
            assert saved.fit is fit
        with pytest.raises(ValueError, match="hard limit only"):
            await gw.guard.admin.set_policy("acme", "x", window=Period.DAY, limit_usd=1, fit=True)
        async with gw.client() as http:
            answers = {
                key: await http.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": ASKED},
                    headers={**LONG, "x-test-key": key},
                )
                for key in ("alpha", "beta")
            }
        listed = {p.api_key_id: p.fit for p in await gw.guard.admin.list_policies("acme")}
    assert answers["alpha"].status_code == 200 and int(answers["alpha"].headers[FITTED]) > 900
    assert answers["beta"].status_code == 429 and FITTED not in answers["beta"].headers
    assert listed == {"alpha": True, "beta": False}


@pytest.mark.parametrize(
    ("by_default", "fit", "fitted"), [(True, False, False), (False, True, True)]
)
async def test_a_budget_opts_out_of_fitting_or_in(
    tmp_path: Path, by_default: bool, fit: bool, fitted: bool
) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1_000, "fit": fit}})
    gw = BudgetGateway(
        tmp_path,
        budgets=budgets,
        app=fake_upstream(),
        fit_min_output_tokens=100,
        fit_by_default=by_default,
    )
    async with gw, gw.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": ASKED},
            headers=LONG,
        )
    assert r.status_code == (200 if fitted else 429)
    assert (FITTED in r.headers) is fitted
