"""The ASGI adapter: it only speaks ASGI (design.md, "One inference").

Route match → identity → request body → ``guard.admit`` → refusal, or the app with an
observing ``send`` → ``guard.finish``, exactly once, in ``finally``. Every decision (who may
pass, which statuses are charged, which usage and model count) is the engine's.

Pure ASGI: every response message is forwarded as soon as the app sends it; usage is read from
copies as they pass. An admitted request's state lives in one ``_Exchange`` and its body
replay.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine.budgets import BudgetGate, gate_for
from ..engine.guard import SpendGuard
from ..engine.round import Round
from ..integrations.litellm import LiteLLMRouting, litellm_routing
from ..ledger import Ledger
from ..providers.pool import ProviderPool
from ..providers.routing import Candidates, ProviderRouting, candidates_of
from ..settings import Settings, load_settings
from ..store import Store
from .admission import (
    HEADER_INFERENCE_ID,
    STATE_INFERENCE_ID,
    STATE_MODEL,
    STATE_RECORD_ID,
    STATE_T0,
    Disconnected,
    Exchange,
    admit_inference,
    bad_request,
    replay,
)
from .deferred import deferred_inference
from .errors import send_error
from .fit import with_length
from .identity import IdentityResolver, resolve
from .lifespan import run_lifespan
from .parties import Parties
from .remaining import own_headers
from .request import BadRequest
from .routes import AMBIGUOUS, RouteMatch, RouteTable
from .unlisted import BODY_METHODS, UnlistedInferences
from .wiring import Wiring

__all__ = [
    "HEADER_INFERENCE_ID",
    "STATE_INFERENCE_ID",
    "STATE_MODEL",
    "STATE_RECORD_ID",
    "STATE_T0",
    "SpendGuardMiddleware",
]

log = logging.getLogger("spendguard")


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"Request body exceeds {limit} bytes.", status=413)


class SpendGuardMiddleware:
    """Spend limits for the inference routes of a Starlette/FastAPI app.

    ``app.add_middleware(SpendGuardMiddleware)`` reads ``SPENDGUARD_*`` settings; pass
    ``settings=``, ``resolve_identity=`` (sync or async, gets an ``HTTPConnection`` and returns
    an ``Identity``, a ``(team_id, api_key_id)`` tuple or None) or a ready ``guard=``.
    ``candidates=`` (a model and identity in, provider key ids out) leases a provider key
    at admission, as ``provider_candidates`` in the settings does, from ``pool=`` (default:
    the guard's, beside its store).
    """

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings | None = None,
        *,
        resolve_identity: IdentityResolver | None = None,
        guard: SpendGuard | None = None,
        store: Store | None = None,
        ledger: Ledger | None = None,
        budgets: BudgetGate | None = None,
        candidates: Candidates | None = None,
        pool: ProviderPool | None = None,
    ) -> None:
        self.app = app
        self.settings = settings or (guard.settings if guard is not None else load_settings())
        self.enabled = self.settings.enabled
        self.resolve_identity = resolve_identity
        self.routes = RouteTable(self.settings.routes)
        # Who a request bills within its team, and its tags: from the sources trusted.
        self.parties = Parties(
            self.settings.end_user_from, self.settings.tags_from, self.settings.customer_from
        )
        # What every answer tells the caller about its own limits (opt-in).
        self.own_headers = own_headers(
            self.settings.remaining_headers, self.settings.ratelimit_headers
        )
        self.unlisted = UnlistedInferences(self.settings)
        self.wiring = Wiring(
            self.settings, self.routes, resolve_identity, self.unlisted.pass_routes
        )
        # Disabled means a strict no-op: not even a database file or a price table.
        self.guard: SpendGuard | None = None
        if self.enabled:
            self.guard = guard or SpendGuard(self.settings, store=store, ledger=ledger)
        # Budgets (token and USD quotas) are checked beside spend limits; None: not configured.
        self.budgets = budgets
        if budgets is None and self.guard is not None:
            self.budgets = gate_for(self.guard)
        if self.budgets is not None and self.guard is not None and self.budgets.on_alert is None:
            self.budgets.on_alert = self.guard.alerts.note_bucket  # budgets' threshold alerts
        if self.budgets is not None and self.guard is not None:
            self.guard.budgets = self.budgets  # recovery closes their holds
        # Provider keys leased at admission: the gateway's hook, or the settings' globs.
        self.providers: ProviderRouting | None = None
        if self.guard is not None:
            if candidates is None and self.settings.provider_candidates:
                candidates = candidates_of(self.settings.provider_candidates)
            if candidates is not None:
                self.providers = ProviderRouting(pool or self.guard.pool, candidates)
        # Every part, admitted in one round and finished in one (engine/round.py).
        self.round: Round | None = None
        if self.guard is not None:
            self.round = Round(self.guard, self.budgets, self.providers)
        # The LiteLLM proxy's router, when the app is LiteLLM's (integrations/litellm.py):
        # looked for once the app started, since its router is made by its startup.
        self.litellm: LiteLLMRouting | None = None
        self._looked_for_router = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard is None or self.round is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            if self.wiring.pending:  # the first request: checks made once (asgi/wiring.py)
                self.wiring.first_request(scope, self.app)
                self._find_router(self.guard, scope)
            match = self.routes.match(scope)
            if match is not None:
                if match is AMBIGUOUS:
                    message = "The request path is ambiguous (encoded too often, or control "
                    message += "characters); send it plainly."
                    await send_error(send, match.dialect, 400, "invalid_request_path", message)
                    return
                if self.wiring.unstarted:  # the first inference, and no lifespan ran
                    await self.wiring.start_without_lifespan(self.guard)
                await self._inference(self.round, scope, receive, send, match)
                return
            if scope["method"] in BODY_METHODS:  # an inference nobody listed? (asgi/unlisted.py)
                await self.unlisted(self.app, scope, receive, send)
                return
        elif scope["type"] == "lifespan":
            self.wiring.lifespan(scope, self.app)
            started = partial(self._started, self.guard, scope)
            await run_lifespan(self.app, self.guard, scope, receive, send, started)
            return
        await self.app(scope, receive, send)

    def _started(self, guard: SpendGuard, scope: Scope) -> None:
        self.wiring.started(scope, self.app)
        self._find_router(guard, scope)

    def _find_router(self, guard: SpendGuard, scope: Scope) -> None:
        if self._looked_for_router:
            return
        self._looked_for_router = True
        self.litellm = litellm_routing((scope.get("app"), self.app), guard.prices)
        if self.litellm is not None:
            self._read_router(guard, self.litellm)

    def _read_router(self, guard: SpendGuard, router: LiteLLMRouting) -> None:
        """The router's model names into the price table, when they changed (no await: a
        request sees the old table or the new one, whole)."""
        table = router.prices()
        if table is None:
            return
        guard.use_prices(table)
        if self.budgets is not None:
            self.budgets.prices = table  # budgets price by the same names

    async def _inference(
        self, round_: Round, scope: Scope, receive: Receive, send: Send, match: RouteMatch
    ) -> None:
        route, dialect, path_model = match
        router = self.litellm
        if router is not None:
            self._read_router(round_.guard, router)  # at most every few seconds, in integrations/
        state: dict[str, Any] = scope.setdefault("state", {})
        identity = await resolve(self.resolve_identity, HTTPConnection(scope))
        body: bytes | None = None
        if identity is not None:  # no identity: answered without reading the body
            try:
                body = await self._read_body(scope, receive)
            except Disconnected:
                return
            except BadRequest as exc:
                await bad_request(dialect, exc)(send)
                return
        elif self.wiring.defers(scope, self.app):  # the route's own auth dependency resolves it
            await deferred_inference(
                round_,
                self.app,
                scope,
                receive,
                send,
                match=match,
                read_body=self._read_body,
                resolver=self.resolve_identity,
                no_identity=self.wiring.no_identity,
                own=self.own_headers,
                routed_by=router.routed if router is not None else None,
                parties=self.parties,
            )
            return
        else:
            self.wiring.no_identity(scope)
        outcome = await admit_inference(
            round_,
            identity,
            body,
            send,
            route=route,
            dialect=dialect,
            path_model=path_model,
            state=state,
            own=self.own_headers,
            routed_by=router.routed if router is not None else None,
            rewritable=True,
            parties=self.parties,
            headers=scope.get("headers", ()),
        )
        if outcome is None:  # passed through, unobserved
            await self.app(scope, receive if body is None else replay(body, receive), send)
            return
        if not isinstance(outcome, Exchange):
            await outcome(send)
            return
        forwarded = body or b""
        if outcome.body is not None:  # its output cap fitted to what a hard limit has left
            forwarded = outcome.body
            scope = with_length(scope, len(forwarded))
        try:
            await self.app(scope, replay(forwarded, receive), outcome.send)
        finally:
            await outcome.finish()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        if not message.get("more_body", False):
            # The whole body in one message, as servers pass small ones: already read, so
            # its declared length has nothing left to save us from.
            if len(chunk) > limit:
                raise _too_large(limit)
            return chunk if type(chunk) is bytes else bytes(chunk)
        # More to come: refuse a body declared too large before reading the rest of it.
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise BadRequest("Invalid Content-Length header.") from None
                if declared > limit:
                    raise _too_large(limit)
        chunks: list[bytes] = [chunk]
        size = len(chunk)
        while True:
            if size > limit:
                raise _too_large(limit)
            if not message.get("more_body", False):
                return b"".join(chunks)
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
