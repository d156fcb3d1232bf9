"""An inference whose identity an app dependency resolves (:mod:`.dependency`).

The middleware reads the body and calls the app at once, with an ``admit`` hook in the request
state; ``spendguard_guard`` calls it once the app's auth dependency has run. Until then nothing
is decided: a response the app sends before (its own 401 for a bad key) passes untouched and is
not charged. After an admission the response is observed and finished exactly as on the
middleware's own path (``SpendGuardMiddleware._inference``): once, in ``finally``, shielded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.round import Round
from .admission import (
    STATE_RECORD_ID,
    Disconnected,
    Exchange,
    RoutedBy,
    abandon,
    admit_inference,
    bad_request,
    replay,
)
from .dependency import STATE_ADMIT, Refused
from .identity import IdentityResolver, resolve
from .parties import Parties
from .remaining import OwnHeaders
from .request import BadRequest
from .routes import RouteMatch


async def deferred_inference(
    round_: Round,
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    match: RouteMatch,
    read_body: Callable[[Scope, Receive], Awaitable[bytes]],
    resolver: IdentityResolver | None,
    no_identity: Callable[[Scope], None],
    own: OwnHeaders | None,
    routed_by: RoutedBy | None = None,
    parties: Parties | None = None,
) -> None:
    """Read the body, call the app with the admission hook; observe and finish what it
    admitted."""
    try:
        body = await read_body(scope, receive)
    except Disconnected:
        return
    except BadRequest as exc:  # too large: answered before anything else
        await bad_request(match.dialect, exc)(send)
        return

    state: dict[str, Any] = scope.setdefault("state", {})
    exchange: Exchange | None = None
    started = False

    async def admit() -> None:
        nonlocal exchange
        if exchange is not None or STATE_RECORD_ID in state:
            return  # asked twice (the dependency listed twice): one inference, one admission
        identity = await resolve(resolver, HTTPConnection(scope))
        if identity is None:
            no_identity(scope)
        outcome = await admit_inference(
            round_,
            identity,
            body,
            send,
            route=match.route,
            dialect=match.dialect,
            path_model=match.model,
            state=state,
            own=own,
            routed_by=routed_by,
            parties=parties,
            headers=scope.get("headers", ()),
        )
        if isinstance(outcome, Exchange):
            exchange = outcome
        elif outcome is not None:
            raise Refused(outcome)

    async def observed_send(message: Message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
        if exchange is not None:  # else: the app answered before asking (its own 401)
            await exchange.send(message)
        else:
            await send(message)

    state[STATE_ADMIT] = admit
    try:
        await app(scope, replay(body, receive), observed_send)
    except Refused as refused:
        if started:
            await abandon(refused.respond)  # no answer can be sent: give back what it holds
            raise
        await refused.respond(send)
    finally:
        state.pop(STATE_ADMIT, None)
        if exchange is not None:
            await exchange.finish()
