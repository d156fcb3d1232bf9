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
from collections.abc import Awaitable
from datetime import datetime
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..budgets import BudgetAdmission, BudgetGate, gate_for
from ..budgets.responses import send_budget_refusal
from ..engine.decision import Admission, InferenceRequest, Verdict
from ..engine.guard import SpendGuard
from ..ledger import Ledger
from ..settings import Settings, load_settings
from ..store import Store
from ..usage import BodyObserver, Dialect
from .deferred import deferred_inference
from .errors import send_error, send_refusal
from .finishing import finish, replay
from .identity import IdentityResolver, resolve
from .lifespan import run_lifespan
from .ratelimit import rate_limit_headers
from .remaining import remaining_headers
from .request import BadRequest, parse_request
from .routes import RouteTable
from .wiring import Wiring

log = logging.getLogger("spendguard")

STATE_INFERENCE_ID = "spendguard_inference_id"
STATE_T0 = "spendguard_t0"
STATE_RECORD_ID = "spendguard_record_id"
HEADER_INFERENCE_ID = "x-spendguard-inference-id"
_INFERENCE_ID_HEADER = HEADER_INFERENCE_ID.encode()


def _content_headers(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """Content-Type and Content-Encoding of a response, from its raw ASGI headers."""
    content_type = content_encoding = None
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif lname == b"content-encoding" and content_encoding is None:
            content_encoding = value.decode("latin-1")
    return content_type, content_encoding


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"Request body exceeds {limit} bytes.", status=413)


class _Disconnected(Exception):
    """The client went away while we read the request body: nothing to answer or charge."""


class _Exchange:
    """An admitted inference's response as the app sends it: every message forwarded as it
    comes, its status and usage observed on the way.

    One slotted object rather than a closure: each object a request keeps alive through the
    app call is walked by every garbage collection that runs meanwhile, and under load most of
    them are promoted to the oldest generation before they die. The two closures (this and the
    body replay) and their cells were twelve such objects per request; now they are three:
    this, its bound ``send`` and the replay (``finishing.replay``).
    """

    __slots__ = ("_added", "_admission", "_guard", "_send", "observer", "status")

    def __init__(
        self,
        guard: SpendGuard,
        admission: Admission,
        send: Send,
        added: list[tuple[bytes, bytes]],
    ) -> None:
        self._guard, self._admission, self._added = guard, admission, added
        self._send = send
        self.status = 0  # no response started (yet)
        self.observer: BodyObserver | None = None

    def send(self, message: Message) -> Awaitable[None]:
        # Not a coroutine function: what it does is synchronous, and it hands back the server's
        # own send to await, so no coroutine of ours is made per message (a stream sends one
        # per chunk).
        kind = message["type"]
        if kind == "http.response.body":
            observer = self.observer
            if observer is not None:
                observer.feed(message.get("body", b""))
        elif kind == "http.response.start":
            status = self.status = message["status"]
            headers = message["headers"] = list(message.get("headers", ()))
            content_type, content_encoding = _content_headers(headers)
            self.observer = self._guard.observe(
                self._admission, status, content_type, content_encoding
            )
            headers.extend(self._added)
        return self._send(message)


class SpendGuardMiddleware:
    """Spend limits for the inference routes of a Starlette/FastAPI app.

    ``app.add_middleware(SpendGuardMiddleware)`` reads ``SPENDGUARD_*`` settings; pass
    ``settings=``, ``resolve_identity=`` (sync or async, gets an ``HTTPConnection`` and returns
    an ``Identity``, a ``(team_id, api_key_id)`` tuple or None) or a ready ``guard=``.
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
    ) -> None:
        self.app = app
        self.settings = settings or (guard.settings if guard is not None else load_settings())
        self.enabled = self.settings.enabled
        self.resolve_identity = resolve_identity
        self.routes = RouteTable(self.settings.routes)
        self.wiring = Wiring(self.settings, self.routes, resolve_identity)
        # Disabled means a strict no-op: not even a database file or a price table.
        self.guard: SpendGuard | None = None
        if self.enabled:
            self.guard = guard or SpendGuard(self.settings, store=store, ledger=ledger)
        # Budgets (token and USD quotas) are checked beside spend limits; None: not configured.
        self.budgets = budgets
        if budgets is None and self.guard is not None:
            self.budgets = gate_for(self.guard)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            if self.wiring.pending:  # the first request: checks made once (asgi/wiring.py)
                self.wiring.first_request(scope, self.app)
            match = self.routes.match(scope)
            if match is not None:
                if self.wiring.unstarted:  # the first inference, and no lifespan ran
                    await self.wiring.start_without_lifespan(self.guard)
                await self._inference(self.guard, scope, receive, send, *match)
                return
        elif scope["type"] == "lifespan":
            self.wiring.lifespan(scope, self.app)
            await run_lifespan(self.app, self.guard, scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _inference(
        self,
        guard: SpendGuard,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        dialect: Dialect,
    ) -> None:
        state: dict[str, Any] = scope.setdefault("state", {})
        identity = await resolve(self.resolve_identity, HTTPConnection(scope))
        body = b""
        request: InferenceRequest | None = None
        if identity is not None:  # no identity: answered without reading the body
            try:
                body = await self._read_body(scope, receive)
                request = parse_request(body)
            except _Disconnected:
                return
            except BadRequest as exc:
                code = "request_too_large" if exc.status == 413 else "invalid_request"
                await send_error(send, dialect, exc.status, code, exc.message)
                return
        elif self.wiring.defers(scope):  # the route's own auth dependency resolves it
            await deferred_inference(
                guard,
                self.app,
                scope,
                receive,
                send,
                route=route,
                dialect=dialect,
                read_body=self._read_body,
                resolver=self.resolve_identity,
                retry_of=self._retry_of,
                no_identity=self.wiring.no_identity,
                budgets=self.budgets,
            )
            return
        else:
            self.wiring.no_identity(scope)

        budget: BudgetAdmission | None = None
        if self.budgets is not None and identity is not None and request is not None:
            budget = await self.budgets.admit(identity, request)
            if budget is not None and not budget.allowed:
                await send_budget_refusal(send, dialect, budget)
                return
        t0, inference_id = self._retry_of(state)
        admission = await guard.admit(
            identity, request, route=route, dialect=dialect, t0=t0, inference_id=inference_id
        )
        if admission.verdict is Verdict.PASS:
            await self.app(scope, receive, send)
            return
        if not admission.allowed or admission.decision is None:
            if budget is not None and self.budgets is not None:
                await self.budgets.release(budget)  # spend limits refused: return the hold
            await send_refusal(send, admission, self._remaining_headers(admission))
            return
        decision = admission.decision
        state[STATE_INFERENCE_ID] = decision.inference_id
        state[STATE_T0] = decision.t0
        state[STATE_RECORD_ID] = decision.record_id
        added = [
            (_INFERENCE_ID_HEADER, decision.inference_id.encode()),
            *self._remaining_headers(admission),
            *rate_limit_headers(decision),
        ]
        if budget is not None:
            added.extend(budget.headers)
        exchange = _Exchange(guard, admission, send, added)
        try:
            await self.app(scope, replay(body, receive), exchange.send)
        finally:
            await finish(guard, self.budgets, admission, exchange.status, exchange.observer, budget)

    def _remaining_headers(self, admission: Admission) -> list[tuple[bytes, bytes]]:
        decision = admission.decision
        if not self.settings.remaining_headers or decision is None:
            return []
        return remaining_headers(decision)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
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
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)

    @staticmethod
    def _retry_of(state: dict[str, Any]) -> tuple[datetime | None, str | None]:
        """What the host app marked as the original inference of a retry or fallback (the
        engine decides whether to honour it)."""
        t0, inference_id = state.get(STATE_T0), state.get(STATE_INFERENCE_ID)
        if not isinstance(inference_id, str) or not isinstance(t0, datetime):
            return None, None
        return t0, inference_id
