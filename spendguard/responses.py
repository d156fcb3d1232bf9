"""Error responses spendguard sends itself, in the dialect of the route (OpenAI or Anthropic).

The 429 bodies are exactly R5.2's; they name only the limit that denied, never any usage.
"""

from __future__ import annotations

import json

from starlette.types import Send

from .keys import Scope
from .periods import Period
from .routes import Dialect

_SCOPE_NAMES = {Scope.TEAM: "Team", Scope.API_KEY: "API Key"}
_PERIOD_NAMES = {Period.DAY: "daily", Period.MONTH: "monthly"}

# OpenAI error "type" for each status; Anthropic's envelope has its own type names.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    413: "invalid_request_error",
    429: "insufficient_quota",
    503: "service_unavailable",
}


def limit_message(scope: Scope, period: Period) -> str:
    return f"{_SCOPE_NAMES[scope]} {_PERIOD_NAMES[period]} spend limit exceeded."


def error_body(dialect: Dialect, status: int, code: str, message: str) -> bytes:
    if dialect is Dialect.ANTHROPIC:
        body: dict[str, object] = {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
        }
    else:
        body = {
            "error": {
                "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                "code": code,
                "message": message,
            }
        }
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


async def send_error(
    send: Send,
    dialect: Dialect,
    status: int,
    code: str,
    message: str,
    *,
    retry_after: int | None = None,
) -> None:
    body = error_body(dialect, status, code, message)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
