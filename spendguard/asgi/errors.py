"""Error responses spendguard sends itself, in the dialect of the route (OpenAI or Anthropic).

A 429 names only the limit that denied (its amount, and for a spend limit when it resets),
never any usage. :func:`send_refusal` renders every
admission the engine refused; the adapter decides nothing about it.

A spend-limit or balance 429 carries ``x-should-retry: false``: the official OpenAI and
Anthropic SDKs honour it, so they raise at once instead of retrying a limit that resets
tomorrow (or a balance that never resets by itself). A 503 is left to the SDKs' retries, and so
is a rate's 429 (``rate_limit_exceeded``, with ``Retry-After`` and OpenAI's ``x-ratelimit-*``
headers), unless the request alone is larger than a tokens-per-minute rate.

A request whose hold alone exceeds a hard limit's whole amount can never pass as sent:
``request_exceeds_spend_limit`` (Anthropic ``invalid_request_error``: the request must change,
its message says how), ``x-should-retry: false`` and no ``Retry-After``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Final

from starlette.types import Send

from ..clock import time_text
from ..engine.budgets import OUTAGE_RETRY_AFTER, BudgetAdmission, BudgetVerdict
from ..engine.decision import Admission, Never, Verdict
from ..engine.reservation import usd
from ..limits import Limit, Period, SubjectKind
from ..limits.kinds import KINDS
from ..limits.rates import RateDenial, RateKind
from ..providers.model import NoCapacity
from ..usage import Dialect
from .ratelimit import rate_limit_headers

# Honoured by the OpenAI and Anthropic SDKs: a spend limit is not a transient rate limit.
_NO_RETRY: Final = (b"x-should-retry", b"false")

_SUBJECT_NAMES = {SubjectKind.TEAM: "Team", SubjectKind.API_KEY: "API Key"}
_WINDOW_NAMES = {Period.DAY: "daily", Period.MONTH: "monthly"}

# OpenAI error "type" for each status; Anthropic's envelope has its own type names.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    413: "invalid_request_error",
    429: "insufficient_quota",
    503: "service_unavailable",
}


# A request whose hold alone exceeds a hard limit: its code, and its Anthropic type (the
# request must change; Anthropic's envelope has no code).
REQUEST_EXCEEDS_SPEND_LIMIT: Final = "request_exceeds_spend_limit"
AS_SENT_ANTHROPIC_TYPE: Final = "invalid_request_error"


def limit_name(limit: Limit) -> str:
    """``API Key daily spend limit`` and the like."""
    return f"{_SUBJECT_NAMES[limit.subject.kind]} {_WINDOW_NAMES[limit.window]} spend limit"


def limit_message(limit: Limit, amount: int | None = None, t0: datetime | None = None) -> str:
    """``API Key daily spend limit exceeded.`` and the like; with the limit's ``amount``
    (micro-USD) and the request's ``t0``, what it is and when it resets, so a caller reading
    only the message knows when to come back."""
    if amount is None or t0 is None:
        return f"{limit_name(limit)} exceeded."
    resets = time_text(limit.window.end(t0))
    return f"{limit_name(limit)} exceeded: limit {usd(amount)}, resets at {resets}."


_RATE_NAMES = {
    RateKind.RPM: ("requests per minute", "requests"),
    RateKind.TPM: ("tokens per minute", "tokens"),
    RateKind.PARALLEL: ("parallel requests", "requests"),
}


def rate_message(denial: RateDenial, declared: bool = True) -> str:
    """``Rate limit reached for API Key on requests per minute: limit 60.`` and the like;
    ``declared``: whether the request set its output cap (else the default was reserved)."""
    subject = "API Key" if denial.state.scope is SubjectKind.API_KEY else "Team"
    what = _RATE_NAMES[denial.kind][0]
    message = f"Rate limit reached for {subject} on {what}: limit {denial.limit}"
    if denial.kind is RateKind.TPM:
        message += f", requested {denial.cost}"
        if denial.cost > denial.limit:
            fix = "Lower max_tokens or the prompt."
            if not declared:
                fix = "It sets no max_tokens, so the default output reservation counts: set "
                fix += "max_tokens, or shorten the prompt."
            return f"Request too large for {subject} on {what}: limit {denial.limit}, " + (
                f"requested {denial.cost}. {fix}"
            )
    return message + "."


def error_body(
    dialect: Dialect,
    status: int,
    code: str,
    message: str,
    error_type: str | None = None,
    anthropic_type: str | None = None,
    details: dict[str, object] | None = None,
) -> bytes:
    error: dict[str, object]
    if dialect is Dialect.ANTHROPIC:
        kind = anthropic_type or _ANTHROPIC_TYPES.get(status, "api_error")
        error = {"type": kind, "message": message}
    else:
        error = {
            "type": error_type or _OPENAI_TYPES.get(status, "invalid_request_error"),
            "code": code,
            "message": message,
        }
    if details is not None:
        error["details"] = details
    body = {"type": "error", "error": error} if dialect is Dialect.ANTHROPIC else {"error": error}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


async def send_error(
    send: Send,
    dialect: Dialect,
    status: int,
    code: str,
    message: str,
    *,
    retry_after: int | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
    error_type: str | None = None,
    anthropic_type: str | None = None,
    details: dict[str, object] | None = None,
) -> None:
    body = error_body(dialect, status, code, message, error_type, anthropic_type, details)
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    if retry_after is not None:
        start_headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})


async def send_refusal(
    send: Send, admission: Admission, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """The response to an admission that was not allowed (nothing was charged); ``headers``
    (about the caller's own limits) go on a spend-limit, balance or rate 429."""
    dialect, decision = admission.dialect, admission.decision
    if admission.verdict is Verdict.UNAUTHENTICATED:
        message = "This route needs an authenticated team and API key."
        await send_error(send, dialect, 401, "missing_identity", message)
    elif admission.verdict is Verdict.UNPRICED:
        await send_error(send, dialect, 400, "invalid_request", admission.message)
    elif admission.verdict is Verdict.MODEL_NOT_ALLOWED:
        model = admission.request.model if admission.request is not None else ""
        message = f"Model {model!r} is not allowed for this API key."
        await send_error(send, dialect, 403, "model_not_allowed", message)
    elif admission.verdict is Verdict.RATE_LIMITED and decision and decision.rate_denied:
        rated = decision.rate_denied
        declared = admission.request is None or admission.request.max_tokens is not None
        rate_headers = [*rate_limit_headers(decision), *headers]
        retry = decision.retry_after
        if retry is None:  # larger than the rate itself: no retry can succeed
            rate_headers.append(_NO_RETRY)
        await send_error(
            send,
            dialect,
            429,
            "rate_limit_exceeded",
            rate_message(rated, declared),
            retry_after=retry,
            headers=rate_headers,
            error_type=_RATE_NAMES[rated.kind][1],  # OpenAI's: "requests" or "tokens"
        )
    elif admission.verdict is Verdict.DENY and decision is not None and decision.denied:
        limit = decision.denied_limit
        denial = [_NO_RETRY, *headers]
        if limit is None:  # the prepaid balance is used up: it never resets by itself
            message = "Account balance exhausted."
            await send_error(send, dialect, 429, "insufficient_quota", message, headers=denial)
        elif admission.never is Never.AS_SENT:
            amount = usd(decision.denied.limit)
            message = f"This request can never pass the {limit_name(limit)} of {amount} as "
            message += f"sent: {admission.message}"
            code = REQUEST_EXCEEDS_SPEND_LIMIT
            await send_error(
                send,
                dialect,
                429,
                code,
                message,
                headers=denial,
                error_type=code,
                anthropic_type=AS_SENT_ANTHROPIC_TYPE,
            )
        else:
            message = limit_message(limit, decision.denied.limit, decision.t0)
            retry = decision.retry_after
            code = "spend_limit_exceeded"
            await send_error(send, dialect, 429, code, message, retry_after=retry, headers=denial)
    else:
        message = "Spend limits cannot be checked right now; retry shortly."
        retry = decision.retry_after if decision is not None else None
        retry = retry or KINDS["spend_limit"].outage_retry_after
        await send_error(send, dialect, 503, "spend_limit_unavailable", message, retry_after=retry)


async def send_no_capacity(dialect: Dialect, refused: NoCapacity, send: Send) -> None:
    """No candidate provider key could take the request: a 429 with the wait until the first
    frees (a cooldown ends, a full minute closes), left to the SDKs' retries; a 503 when none
    ever can as things stand (unregistered keys, or a request larger than every key's TPM).
    The key ids are the gateway's own business: not named."""
    if refused.retry_after is not None:
        message = "No provider key has capacity for this request right now; retry shortly."
        await send_error(
            send,
            dialect,
            429,
            "no_provider_capacity",
            message,
            retry_after=refused.retry_after,
        )
        return
    message = "No provider key configured for this model can take this request."
    await send_error(send, dialect, 503, "no_provider_key", message)


REQUEST_EXCEEDS_BUDGET: Final = "request_exceeds_budget"


async def send_budget_refusal(dialect: Dialect, admission: BudgetAdmission, send: Send) -> None:
    """A budget's refusal. OpenAI routes: ``budget_exceeded`` (type and code) with ``details``
    {scope, window, unit, limit | limit_micro_usd[, model]}; Anthropic routes: the
    ``rate_limit_error`` envelope with the same ``details``. Both 429 with ``Retry-After``: the
    seconds until the denying window has drained enough for the request.

    A request whose estimate alone exceeds a bucket's whole limit never fits, however long it
    waits: ``request_exceeds_budget`` (Anthropic: ``invalid_request_error``, the request must
    change), ``x-should-retry: false`` and no ``Retry-After``; the message says what the
    estimate is made of and the ``max_tokens`` that would fit, ``details`` add the ``reserved``
    amount. An outage: 503 ``budget_unavailable`` with ``Retry-After``."""
    denial = admission.denial
    if admission.verdict is not BudgetVerdict.DENY or denial is None:
        message = "Budgets cannot be checked right now; retry shortly."
        await send_error(
            send, dialect, 503, "budget_unavailable", message, retry_after=OUTAGE_RETRY_AFTER
        )
        return
    if denial.retry_after is None:  # no wait lets it pass: the SDKs must not retry
        code = REQUEST_EXCEEDS_BUDGET
        await send_error(
            send,
            dialect,
            429,
            code,
            denial.message,
            headers=[_NO_RETRY],
            error_type=code,
            anthropic_type=AS_SENT_ANTHROPIC_TYPE,
            details=denial.details(),
        )
        return
    await send_error(
        send,
        dialect,
        429,
        "budget_exceeded",
        denial.message,
        retry_after=denial.retry_after,
        error_type="budget_exceeded",
        details=denial.details(),
    )
