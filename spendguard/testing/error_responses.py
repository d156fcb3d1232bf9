"""The providers' error envelopes: what the fake answers instead of a script when it fails."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from starlette.responses import Response

from .framing import JSON, anthropic_headers, anthropic_json, openai_headers, openai_json
from .routes import Kind

# Status → (error type, code) as OpenAI sends them; other statuses get a generic pair.
_OPENAI_ERRORS: Final[Mapping[int, tuple[str, str | None]]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}
# Status → error type as Anthropic sends it; other statuses get a generic type.
_ANTHROPIC_ERRORS: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_response(kind: Kind, status: int, message: str, request_id: str) -> Response:
    """``status`` with ``message`` in the error envelope of the provider that serves ``kind``."""
    if kind == "messages":
        error_type = _ANTHROPIC_ERRORS.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        body = {
            "type": "error",
            "error": {"type": error_type, "message": message},
            "request_id": request_id,
        }
        return Response(
            anthropic_json(body), status, anthropic_headers(request_id), media_type=JSON
        )
    default = ("server_error", None) if status >= 500 else ("invalid_request_error", None)
    error_type, code = _OPENAI_ERRORS.get(status, default)
    envelope = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return Response(openai_json(envelope), status, openai_headers(request_id), media_type=JSON)
