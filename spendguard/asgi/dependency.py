"""Spend limits checked after the app's own auth dependency (FastAPI ``Depends``).

FastAPI runs a route's dependencies inside the app, after every middleware: the middleware
cannot see the identity an auth dependency finds. On a route that lists
``Depends(spendguard_guard)`` after the auth dependency, the middleware therefore reads the
request and calls the app without checking it; when FastAPI reaches ``spendguard_guard`` the
auth dependency has run (once) and stored the identity in ``request.state``, and
``spendguard_guard`` asks the middleware to admit the inference then, still before the endpoint
calls the provider. A refusal (429, 503, a body that is not a request) is answered by the
middleware in the route's error format; a bad key keeps the app's own error, since the auth
dependency answers it before spendguard is asked::

    @app.post("/v1/chat/completions", dependencies=[Depends(auth), Depends(spendguard_guard)])

The middleware finds such routes when it starts (design.md, "Wiring checks").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.types import Send

from .routes import INFERENCE_ENDINGS

log = logging.getLogger("spendguard")

STATE_ADMIT = "spendguard_admit"  # set by the middleware on a route that defers admission
_warned: set[tuple[int, str]] = set()  # (app, path) warned about, once each


class Refused(Exception):
    """An inference refused inside the app; the middleware answers it with ``respond``."""

    def __init__(self, respond: Callable[[Send], Awaitable[None]]) -> None:
        super().__init__("spendguard refused this inference")
        self.respond = respond


async def spendguard_guard(request: Request) -> None:
    """FastAPI dependency: check spend limits here, after the auth dependencies before it.

    Raises :class:`Refused` for a refused inference (answered by the middleware). On a request
    the middleware does not guard it only warns, once per route: the request is not limited.
    """
    from .admission import STATE_RECORD_ID  # (the admission imports this module)

    state: dict[str, Any] = request.scope.get("state") or {}
    admit = state.get(STATE_ADMIT)
    if admit is not None:
        await admit()
        return
    if STATE_RECORD_ID in state:
        return  # the middleware already admitted it (an identity was known before the app)
    if not request.url.path.rstrip("/").endswith(INFERENCE_ENDINGS):
        return  # listed router-wide, on a route that is no inference
    where = (id(request.scope.get("app")), request.url.path)
    if where not in _warned and len(_warned) < 1000:
        _warned.add(where)
        log.warning(
            "spendguard_guard ran on %s %s, but no SpendGuardMiddleware guards this request, "
            "so it is NOT limited or recorded: add SpendGuardMiddleware to the app and the "
            "path to SPENDGUARD_ROUTES (relative to where the middleware sits)",
            request.method,
            request.url.path,
        )
