"""The budgets' own refusals, in the route's dialect.

OpenAI routes: ``{"error": {"type": "budget_exceeded", "code": "budget_exceeded", "message",
"details": {scope, window, unit, limit | limit_micro_usd[, model]}}}``. Anthropic routes: the
``rate_limit_error`` envelope with the same ``details``. Both 429 with ``Retry-After``: the
seconds until the denying window has drained enough for the request.

A request whose estimate alone exceeds a bucket's whole limit never fits, however long it
waits: ``request_exceeds_budget`` (Anthropic: ``invalid_request_error``, the request must
change), ``x-should-retry: false`` and no ``Retry-After``; the message says what the estimate
is made of and the ``max_tokens`` that would fit, ``details`` add the ``reserved`` amount.
"""

from __future__ import annotations

import json

from starlette.types import Send

from ..usage import Dialect
from .gate import OUTAGE_RETRY_AFTER, BudgetAdmission, BudgetVerdict

REQUEST_EXCEEDS_BUDGET = "request_exceeds_budget"


def budget_error_body(
    dialect: Dialect,
    status: int,
    message: str,
    details: dict[str, object] | None,
    never: bool = False,
) -> bytes:
    error: dict[str, object]
    if dialect is Dialect.ANTHROPIC:
        kind = "rate_limit_error" if status == 429 else "overloaded_error"
        error = {"type": "invalid_request_error" if never else kind, "message": message}
    elif never:
        error = {"type": REQUEST_EXCEEDS_BUDGET, "code": REQUEST_EXCEEDS_BUDGET, "message": message}
    else:
        code = "budget_exceeded" if status == 429 else "budget_unavailable"
        error = {
            "type": code if status == 429 else "service_unavailable",
            "code": code,
            "message": message,
        }
    if details is not None:
        error["details"] = details
    body: dict[str, object] = (
        {"type": "error", "error": error} if dialect is Dialect.ANTHROPIC else {"error": error}
    )
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


async def send_budget_refusal(send: Send, dialect: Dialect, admission: BudgetAdmission) -> None:
    denial = admission.denial
    retry: int | None
    if admission.verdict is BudgetVerdict.DENY and denial is not None:
        status, retry = 429, denial.retry_after
        never = retry is None
        body = budget_error_body(dialect, 429, denial.message, denial.details(), never)
    else:
        status, retry = 503, OUTAGE_RETRY_AFTER
        message = "Budgets cannot be checked right now; retry shortly."
        body = budget_error_body(dialect, 503, message, None)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry is None:  # no wait lets a request that never fits pass: the SDKs must not retry
        headers.append((b"x-should-retry", b"false"))
    else:
        headers.append((b"retry-after", str(retry).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
