"""An inference whose identity an app dependency resolves (:mod:`.dependency`).

The middleware reads the body and calls the app at once, with an ``admit`` hook in the request
state; ``spendguard_guard`` calls it once the app's auth dependency has run. Until then nothing
is decided: a response the app sends before (its own 401 for a bad key) passes untouched and is
not charged. After an admission the response is observed and finished exactly as on the
middleware's own path (``SpendGuardMiddleware._inference``): once, in ``finally``, shielded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..budgets import BudgetAdmission, BudgetGate
from ..budgets.responses import send_budget_refusal
from ..engine.decision import Admission, Verdict
from ..engine.guard import SpendGuard
from ..usage import BodyObserver, Dialect
from .dependency import STATE_ADMIT, Refused
from .errors import send_error, send_refusal
from .finishing import finish, replay
from .identity import IdentityResolver, resolve
from .ratelimit import rate_limit_headers
from .request import BadRequest, parse_request


async def deferred_inference(
    guard: SpendGuard,
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    route: str,
    dialect: Dialect,
    read_body: Callable[[Scope, Receive], Awaitable[bytes]],
    resolver: IdentityResolver | None,
    retry_of: Callable[[dict[str, Any]], tuple[datetime | None, str | None]],
    no_identity: Callable[[Scope], None],
    budgets: BudgetGate | None = None,
) -> None:
    """Read the body, call the app with the admission hook; observe and finish what it
    admitted."""
    # The middleware's names, imported here: it imports this module.
    from .middleware import (
        HEADER_INFERENCE_ID,
        STATE_INFERENCE_ID,
        STATE_RECORD_ID,
        STATE_T0,
        _content_headers,
        _Disconnected,
    )

    try:
        body = await read_body(scope, receive)
    except _Disconnected:
        return
    except BadRequest as exc:  # too large: answered before anything else
        code = "request_too_large" if exc.status == 413 else "invalid_request"
        await send_error(send, dialect, exc.status, code, exc.message)
        return

    state: dict[str, Any] = scope.setdefault("state", {})
    admitted: Admission | None = None
    budget: BudgetAdmission | None = None

    async def admit() -> None:
        nonlocal admitted, budget
        if admitted is not None or STATE_RECORD_ID in state:
            return  # asked twice (the dependency listed twice): one inference, one admission
        identity = await resolve(resolver, HTTPConnection(scope))
        request = None
        if identity is None:
            no_identity(scope)
        else:
            try:
                request = parse_request(body)
            except BadRequest as exc:
                code = "request_too_large" if exc.status == 413 else "invalid_request"
                answer = partial(_send_error, dialect, exc.status, code, exc.message)
                raise Refused(answer) from None
        held: BudgetAdmission | None = None
        if budgets is not None and identity is not None and request is not None:
            held = await budgets.admit(identity, request)  # as on the middleware's own path
            if held is not None and not held.allowed:
                raise Refused(partial(send_budget_refusal, dialect=dialect, admission=held))
        t0, inference_id = retry_of(state)
        admission = await guard.admit(
            identity, request, route=route, dialect=dialect, t0=t0, inference_id=inference_id
        )
        if admission.verdict is Verdict.PASS:
            return
        if not admission.allowed or admission.decision is None:
            if held is not None and budgets is not None:
                await budgets.release(held)  # spend limits refused: return the hold
            raise Refused(partial(send_refusal, admission=admission))
        budget = held
        decision = admission.decision
        state[STATE_INFERENCE_ID] = decision.inference_id
        state[STATE_T0] = decision.t0
        state[STATE_RECORD_ID] = decision.record_id
        admitted = admission

    started = False
    status_code = 0
    observer: BodyObserver | None = None

    async def observed_send(message: Message) -> None:
        nonlocal started, status_code, observer
        if message["type"] == "http.response.body":
            if observer is not None:
                observer.feed(message.get("body", b""))
        elif message["type"] == "http.response.start":
            started = True
            if admitted is not None:  # else: the app answered before asking (its own 401)
                assert admitted.decision is not None
                status_code = message["status"]
                headers = message["headers"] = list(message.get("headers", ()))
                content_type, content_encoding = _content_headers(headers)
                observer = guard.observe(admitted, status_code, content_type, content_encoding)
                inference_id = admitted.decision.inference_id.encode()
                headers.append((HEADER_INFERENCE_ID.encode(), inference_id))
                headers.extend(rate_limit_headers(admitted.decision))
                if budget is not None:
                    headers.extend(budget.headers)
        await send(message)

    state[STATE_ADMIT] = admit
    try:
        await app(scope, replay(body, receive), observed_send)
    except Refused as refused:
        if started:
            raise
        await refused.respond(send)
    finally:
        state.pop(STATE_ADMIT, None)
        if admitted is not None:
            await finish(guard, budgets, admitted, status_code, observer, budget)


async def _send_error(dialect: Dialect, status: int, code: str, message: str, send: Send) -> None:
    await send_error(send, dialect, status, code, message)
