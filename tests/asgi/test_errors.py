"""Tests for spendguard.asgi.errors: the response to every refused admission, in the route's
dialect (OpenAI or Anthropic), with the status, body and Retry-After that go with it."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from starlette.types import Message

from spendguard.asgi.errors import limit_message, send_refusal
from spendguard.engine.decision import Admission, Decision, InferenceRequest, Unavailable, Verdict
from spendguard.identity import Identity
from spendguard.limits import Balance, KeyCodec, Period, Target, key_limit, team_limit
from spendguard.store import LimitState
from spendguard.usage import Dialect

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
T0 = datetime(2026, 9, 30, 12, tzinfo=UTC)
CODEC = KeyCodec("quota", timedelta(days=2))
REQUEST = InferenceRequest(model="m", stream=False, max_tokens=None, estimated_input_tokens=1)
ROUTE = "/v1/chat/completions"


def decision(verdict: Verdict, denied: Target | None = None, **kw: Any) -> Decision:
    limits = (LimitState(CODEC.check(denied, T0), 100, 100),) if denied is not None else ()
    return Decision(verdict, ALPHA, T0, "r1", "r1", limits=limits, **kw)


async def refusal(admission: Admission) -> tuple[int, dict[str, str], Any]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await send_refusal(send, admission)
    start, body = sent
    assert start["type"] == "http.response.start" and body["type"] == "http.response.body"
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body["body"])
    return start["status"], headers, json.loads(body["body"])


def deny(dialect: Dialect, target: Target, retry_after: int | None) -> Admission:
    d = decision(Verdict.DENY, target, retry_after=retry_after)
    return Admission(Verdict.DENY, ROUTE, dialect, REQUEST, d)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (key_limit(ALPHA, Period.DAY), "API Key daily spend limit exceeded."),
        (key_limit(ALPHA, Period.MONTH), "API Key monthly spend limit exceeded."),
        (team_limit(ALPHA, Period.DAY), "Team daily spend limit exceeded."),
        (team_limit(ALPHA, Period.MONTH), "Team monthly spend limit exceeded."),
    ],
)
async def test_a_limit_denial_is_a_429_naming_the_limit_with_retry_after(
    target: Target, message: str
) -> None:
    assert limit_message(target) == message  # type: ignore[arg-type]
    # The answer also says what the limit is and when it resets (T0 is 2026-09-30 12:00 UTC).
    message = message.removesuffix(".") + ": limit $0.0001, resets at 2026-10-01T00:00:00Z."
    status, headers, body = await refusal(deny(Dialect.OPENAI, target, 43_200))
    assert status == 429 and headers["retry-after"] == "43200"
    assert body == {
        "error": {"type": "insufficient_quota", "code": "spend_limit_exceeded", "message": message}
    }
    status, headers, body = await refusal(deny(Dialect.ANTHROPIC, target, 43_200))
    assert status == 429 and headers["retry-after"] == "43200"
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": message}}


@pytest.mark.parametrize("dialect", list(Dialect))
@pytest.mark.parametrize(
    ("target", "retry_after"), [(key_limit(ALPHA, Period.DAY), 60), (Balance("acme"), None)]
)
async def test_a_spend_denial_tells_sdks_not_to_retry(
    dialect: Dialect, target: Target, retry_after: int | None
) -> None:
    _, headers, _ = await refusal(deny(dialect, target, retry_after))
    assert headers["x-should-retry"] == "false"


async def test_an_outage_leaves_retrying_to_the_sdk() -> None:
    d = decision(Verdict.UNAVAILABLE, retry_after=1, unavailable=Unavailable.STORE)
    _, headers, _ = await refusal(Admission(Verdict.UNAVAILABLE, ROUTE, Dialect.OPENAI, REQUEST, d))
    assert "x-should-retry" not in headers


async def test_extra_headers_go_on_a_spend_denial_only() -> None:
    extra = [(b"x-spendguard-remaining-usd-day", b"0.000000")]
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await send_refusal(send, deny(Dialect.OPENAI, key_limit(ALPHA, Period.DAY), 5), extra)
    d = decision(Verdict.UNAVAILABLE, retry_after=1, unavailable=Unavailable.STORE)
    unavailable = Admission(Verdict.UNAVAILABLE, ROUTE, Dialect.OPENAI, REQUEST, d)
    await send_refusal(send, unavailable, extra)
    denied, outage = (dict(m["headers"]) for m in sent if m["type"] == "http.response.start")
    assert denied[b"x-spendguard-remaining-usd-day"] == b"0.000000"
    assert b"x-spendguard-remaining-usd-day" not in outage


@pytest.mark.parametrize("dialect", list(Dialect))
async def test_a_balance_denial_is_a_429_without_retry_after(dialect: Dialect) -> None:
    status, headers, body = await refusal(deny(dialect, Balance("acme"), None))
    assert status == 429 and "retry-after" not in headers  # a balance never resets by itself
    message = "Account balance exhausted."
    if dialect is Dialect.OPENAI:
        assert body == {
            "error": {
                "type": "insufficient_quota",
                "code": "insufficient_quota",
                "message": message,
            }
        }
    else:
        assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": message}}


async def test_missing_identity_is_a_401() -> None:
    status, headers, body = await refusal(Admission(Verdict.UNAUTHENTICATED, ROUTE, Dialect.OPENAI))
    assert status == 401 and "retry-after" not in headers
    assert body["error"]["code"] == "missing_identity"
    assert body["error"]["type"] == "invalid_request_error"
    status, _, body = await refusal(Admission(Verdict.UNAUTHENTICATED, ROUTE, Dialect.ANTHROPIC))
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "authenticated team" in body["error"]["message"]


async def test_an_unpriced_model_is_a_400_with_the_engines_message() -> None:
    message = "Model 'mystery' has no price."
    admission = Admission(Verdict.UNPRICED, ROUTE, Dialect.OPENAI, REQUEST, message=message)
    status, headers, body = await refusal(admission)
    assert status == 400 and "retry-after" not in headers
    assert body == {
        "error": {"type": "invalid_request_error", "code": "invalid_request", "message": message}
    }
    admission = Admission(Verdict.UNPRICED, ROUTE, Dialect.ANTHROPIC, REQUEST, message=message)
    _, _, body = await refusal(admission)
    assert body["error"] == {"type": "invalid_request_error", "message": message}


@pytest.mark.parametrize("why", list(Unavailable))
async def test_unavailable_is_a_503_retried_after_its_decision(why: Unavailable) -> None:
    d = decision(Verdict.UNAVAILABLE, retry_after=7, unavailable=why)
    status, headers, body = await refusal(
        Admission(Verdict.UNAVAILABLE, ROUTE, Dialect.OPENAI, REQUEST, d)
    )
    assert status == 503 and headers["retry-after"] == "7"
    assert body["error"]["code"] == "spend_limit_unavailable"
    assert body["error"]["type"] == "service_unavailable"
    status, _, body = await refusal(
        Admission(Verdict.UNAVAILABLE, ROUTE, Dialect.ANTHROPIC, REQUEST, d)
    )
    assert status == 503 and body["error"]["type"] == "overloaded_error"


async def test_unavailable_without_a_retry_time_says_one_second() -> None:
    d = decision(Verdict.UNAVAILABLE, unavailable=Unavailable.STORE)
    for admission in (
        Admission(Verdict.UNAVAILABLE, ROUTE, Dialect.OPENAI, REQUEST, d),
        Admission(Verdict.UNAVAILABLE, ROUTE, Dialect.OPENAI, REQUEST),  # no decision at all
    ):
        status, headers, _ = await refusal(admission)
        assert status == 503 and headers["retry-after"] == "1"


async def test_non_ascii_messages_are_sent_as_utf8() -> None:
    message = "Model 'modèle-é' has no price."
    admission = Admission(Verdict.UNPRICED, ROUTE, Dialect.OPENAI, REQUEST, message=message)
    _, _, body = await refusal(admission)
    assert body["error"]["message"] == message


def test_rate_429_in_both_dialects() -> None:
    from spendguard.asgi.errors import error_body, rate_message
    from spendguard.limits.model import SubjectKind
    from spendguard.limits.rates import RateDenial, RateKind, Rates, RateState

    team = RateState(SubjectKind.TEAM, Rates(tpm=100), 0, 0, 0, 90, 0, 0)
    denial = RateDenial(team, RateKind.TPM, 20)
    message = rate_message(denial)
    assert message == "Rate limit reached for Team on tokens per minute: limit 100, requested 20."
    openai_body = json.loads(
        error_body(Dialect.OPENAI, 429, "rate_limit_exceeded", message, "tokens")
    )
    assert openai_body["error"]["code"] == "rate_limit_exceeded"
    assert openai_body["error"]["type"] == "tokens"
    anthropic_body = json.loads(error_body(Dialect.ANTHROPIC, 429, "rate_limit_exceeded", message))
    assert anthropic_body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": message},
    }
