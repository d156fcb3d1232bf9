"""The ASGI adapter: route match → identity → preflight → the app with an observing ``send``
→ postflight, exactly once, in ``finally``.

Pure ASGI (R1.1): every response message is forwarded as soon as the app sends it; usage is
read from copies as they pass. Per-request state lives in the closures of ``_inference``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import anyio
from anyio.abc import TaskGroup
from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .guard import Decision, SpendGuard, Verdict
from .identity import IdentityResolver, resolve
from .ledger import Ledger
from .periods import as_utc
from .request_body import BadRequest, InferenceRequest, parse_request
from .responses import limit_message, send_error
from .routes import Dialect, RouteTable
from .settings import MissingIdentity, Settings, load_settings
from .store.base import Store
from .usage import BodyObserver, estimate_usage, observer_for

log = logging.getLogger("spendguard")

STATE_INFERENCE_ID = "spendguard_inference_id"
STATE_T0 = "spendguard_t0"
STATE_RECORD_ID = "spendguard_record_id"
HEADER_INFERENCE_ID = "x-spendguard-inference-id"


class _Disconnected(Exception):
    """The client went away while we read the request body: nothing to answer or charge."""


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
    ) -> None:
        self.app = app
        self.settings = settings or (guard.settings if guard is not None else load_settings())
        self.enabled = self.settings.enabled
        self.resolve_identity = resolve_identity
        self.routes = RouteTable(self.settings.routes)
        # Disabled means a strict no-op (R1.3): not even a database file or a price table.
        self.guard: SpendGuard | None = None
        if self.enabled:
            self.guard = guard or SpendGuard(self.settings, store=store, ledger=ledger)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            match = self.routes.match(scope)
            if match is not None:
                await self._inference(self.guard, scope, receive, send, *match)
                return
        elif scope["type"] == "lifespan":
            await self._lifespan(self.guard, scope, receive, send)
            return
        await self.app(scope, receive, send)

    # -- lifespan (R1.4) ------------------------------------------------------------------
    async def _lifespan(
        self, guard: SpendGuard, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Start the background tasks when the app reports started, stop (and flush) them
        before reporting shut down: adding the middleware is enough.

        An app that does not speak lifespan (it raises, or returns without answering) gets
        the protocol run by spendguard itself, so the worker runs all the same.
        """
        seen = {"startup": False, "answered": False}
        async with anyio.create_task_group() as tg:

            async def lifespan_receive() -> Message:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    seen["startup"] = True
                return message

            async def lifespan_send(message: Message) -> None:
                if message["type"] == "lifespan.startup.complete":
                    seen["answered"] = True
                    if not await self._start(guard, tg, send):
                        return
                elif message["type"] == "lifespan.startup.failed":
                    seen["answered"] = True
                elif message["type"] == "lifespan.shutdown.complete":
                    await guard.stop()
                await send(message)

            try:
                await self.app(scope, lifespan_receive, lifespan_send)
            except Exception:
                if seen["answered"]:
                    raise
                log.info("the app does not handle ASGI lifespan; spendguard runs it itself")
            try:
                if not seen["answered"]:
                    await self._own_lifespan(guard, tg, seen["startup"], receive, send)
            finally:
                if guard.running:
                    await guard.stop()

    async def _start(self, guard: SpendGuard, tg: TaskGroup, send: Send) -> bool:
        try:
            await guard.start(task_group=tg)
            return True
        except Exception as exc:
            log.exception("spendguard failed to start")
            await send({"type": "lifespan.startup.failed", "message": f"spendguard: {exc}"})
            return False

    async def _own_lifespan(
        self, guard: SpendGuard, tg: TaskGroup, got_startup: bool, receive: Receive, send: Send
    ) -> None:
        if not got_startup:
            await receive()  # lifespan.startup
        if not await self._start(guard, tg, send):
            return
        await send({"type": "lifespan.startup.complete"})
        while (await receive())["type"] != "lifespan.shutdown":
            pass
        await guard.stop()
        await send({"type": "lifespan.shutdown.complete"})

    # -- one inference --------------------------------------------------------------------
    async def _inference(
        self,
        guard: SpendGuard,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        dialect: Dialect,
    ) -> None:
        now = guard.clock()
        state: dict[str, Any] = scope.setdefault("state", {})
        identity = await resolve(self.resolve_identity, HTTPConnection(scope))
        if identity is None:
            if self.settings.missing_identity is MissingIdentity.ALLOW:
                await self.app(scope, receive, send)
                return
            await send_error(
                send,
                dialect,
                401,
                "missing_identity",
                "This route needs an authenticated team and API key.",
            )
            return

        try:
            body = await self._read_body(scope, receive)
            request = parse_request(body)
            if guard.coster.rejects_unknown and not guard.coster.is_priced(request.model):
                raise BadRequest(f"Model {request.model!r} has no price.", param="model")
        except _Disconnected:
            return
        except BadRequest as exc:
            code = "request_too_large" if exc.status == 413 else "invalid_request"
            await send_error(send, dialect, exc.status, code, exc.message)
            return

        t0, inference_id = self._retry_of(state, now)
        decision = await guard.preflight(identity, t0, inference_id=inference_id)
        if decision.verdict is not Verdict.ALLOW:
            await self._refuse(decision, dialect, send)
            return
        state[STATE_INFERENCE_ID] = decision.inference_id
        state[STATE_T0] = t0
        state[STATE_RECORD_ID] = decision.record_id

        body_sent = False

        async def replay_receive() -> Message:
            # The app reads the body we already consumed; after it, the real receive (so the
            # app still sees http.disconnect).
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status_code = 0
        observer: BodyObserver | None = None
        inference_header = decision.inference_id.encode()

        async def observed_send(message: Message) -> None:
            nonlocal status_code, observer
            if message["type"] == "http.response.start":
                status_code = message["status"]
                headers = MutableHeaders(scope=message)
                if 200 <= status_code < 300:
                    observer = observer_for(
                        dialect.value,
                        headers.get("content-type"),
                        headers.get("content-encoding", "identity"),
                    )
                headers.raw.append((HEADER_INFERENCE_ID.encode(), inference_header))
            elif observer is not None and message["type"] == "http.response.body":
                observer.feed(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, replay_receive, observed_send)
        finally:
            # Exactly once, however the app ended: return, exception, disconnect or
            # cancellation; shielded so a cancelled request still settles its charge.
            with anyio.CancelScope(shield=True), anyio.move_on_after(15):
                await self._postflight(guard, decision, request, route, status_code, observer)

    async def _postflight(
        self,
        guard: SpendGuard,
        decision: Decision,
        request: InferenceRequest,
        route: str,
        status_code: int,
        observer: BodyObserver | None,
    ) -> None:
        if not 200 <= status_code < 300:
            return
        usage = observer.result() if observer is not None else None
        if usage is None:
            usage = estimate_usage(
                request.estimated_input_tokens, observer.output_chars if observer else 0
            )
        model = request.model
        reported = observer.model if observer is not None else None
        if reported and guard.coster.is_priced(reported):
            model = reported  # what was actually served (aliases, fallbacks)
        try:
            await guard.postflight(
                decision, model=model, route=route, status_code=status_code, usage=usage
            )
        except Exception:  # the response is out; a bug here must not turn into a 500
            log.exception("spendguard postflight failed for record %s", decision.record_id)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = BadRequest(f"Request body exceeds {limit} bytes.", status=413)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        raise too_large
                except ValueError:
                    raise BadRequest("Invalid Content-Length header.") from None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _retry_of(self, state: dict[str, Any], now: datetime) -> tuple[datetime, str | None]:
        """R3.1: a retry or fallback the host app marked keeps the original id and ``t0``."""
        t0, inference_id = state.get(STATE_T0), state.get(STATE_INFERENCE_ID)
        if not isinstance(inference_id, str) or not isinstance(t0, datetime) or t0.tzinfo is None:
            return now, None
        t0 = as_utc(t0)
        # A t0 from the future or from beyond the cache's grace would address keys that must
        # not exist; such a marker is ignored rather than trusted.
        if t0 > now or now - t0 > timedelta(seconds=self.settings.key_grace / 2):
            return now, None
        return t0, inference_id[:64]

    async def _refuse(self, decision: Decision, dialect: Dialect, send: Send) -> None:
        denied = decision.denied
        if decision.verdict is Verdict.DENY and denied is not None:
            if denied.candidate.period is None:  # the prepaid balance, not a period limit
                await send_error(
                    send, dialect, 429, "insufficient_quota", "Account balance exhausted."
                )
                return
            await send_error(
                send,
                dialect,
                429,
                "spend_limit_exceeded",
                limit_message(denied.candidate.scope, denied.candidate.period),
                retry_after=decision.retry_after,
            )
            return
        await send_error(
            send,
            dialect,
            503,
            "spend_limit_unavailable",
            "Spend limits cannot be checked right now; retry shortly.",
            retry_after=decision.retry_after or 1,
        )
