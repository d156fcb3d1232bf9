"""An inference's admission as the ASGI app sees it, for the middleware's own path and for
the ``Depends(spendguard_guard)`` path alike: parse the body, ask the engine's one round
(:class:`~spendguard.engine.round.Round`), and render what it decided: the refusal to send,
or the response headers and the :class:`Exchange` that observes and finishes the response.

Both paths call :func:`admit_inference` and get the same three outcomes: ``None`` (pass
through unobserved), a :data:`Refusal` to send, or an :class:`Exchange`. So they cannot
differ in checks, refusals or headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from functools import partial
from typing import Any

from starlette.types import Message, Receive, Send

from ..engine.decision import Admission, InferenceRequest
from ..engine.round import Admitted, Named, Refused, Round
from ..identity import Identity
from ..limits.kinds import KINDS
from ..providers.routing import STATE_PROVIDER_KEY
from ..usage import BodyObserver, Dialect
from .errors import send_budget_refusal, send_error, send_no_capacity, send_refusal
from .fit import FIT_HEADER, with_output_cap
from .parties import Parties
from .ratelimit import rate_limit_headers
from .remaining import OwnHeaders
from .request import BadRequest, parse_request

STATE_INFERENCE_ID = "spendguard_inference_id"
STATE_T0 = "spendguard_t0"
STATE_RECORD_ID = "spendguard_record_id"
STATE_MODEL = "spendguard_model"
"""Set by the app (``request.state.spendguard_model``) before its response ends: the model it
routed the inference to, charged instead of the request's (when the price table prices it)."""
HEADER_INFERENCE_ID = "x-spendguard-inference-id"
_INFERENCE_ID_HEADER = HEADER_INFERENCE_ID.encode()


class Disconnected(Exception):
    """The client went away while we read the request body: nothing to answer or charge."""


# A response to send instead of calling the app's endpoint.
Refusal = Callable[[Send], Awaitable[None]]
# The model a response's headers say its gateway routed to (a known gateway's, or None).
RoutedBy = Callable[[list[tuple[bytes, bytes]]], str | None]


def content_headers(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """Content-Type and Content-Encoding of a response, from its raw ASGI headers."""
    content_type = content_encoding = None
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif lname == b"content-encoding" and content_encoding is None:
            content_encoding = value.decode("latin-1")
    return content_type, content_encoding


def bad_request(dialect: Dialect, exc: BadRequest) -> Refusal:
    code = "request_too_large" if exc.status == 413 else "invalid_request"
    return partial(_send_error, dialect, exc.status, code, exc.message)


async def _send_error(
    dialect: Dialect,
    status: int,
    code: str,
    message: str,
    send: Send,
    *,
    retry_after: int | None = None,
) -> None:
    await send_error(send, dialect, status, code, message, retry_after=retry_after)


class Exchange:
    """An admitted inference's response as the app sends it: every message forwarded as it
    comes, its status and usage observed on the way, spendguard's headers added.

    One slotted object rather than a closure: each object a request keeps alive through the
    app call is walked by every garbage collection that runs meanwhile, and under load most of
    them are promoted to the oldest generation before they die.
    """

    __slots__ = (
        "_added",
        "_round",
        "_routed_by",
        "_send",
        "_state",
        "admitted",
        "body",
        "observer",
        "routed",
        "status",
    )

    def __init__(
        self,
        round_: Round,
        admitted: Admitted,
        send: Send,
        added: list[tuple[bytes, bytes]],
        state: dict[str, Any],
        routed_by: RoutedBy | None = None,
    ) -> None:
        self._round, self.admitted, self._added = round_, admitted, added
        self._send, self._state, self._routed_by = send, state, routed_by
        self.status = 0  # no response started (yet)
        self.observer: BodyObserver | None = None
        self.routed: str | None = None  # what the response's headers say was routed to
        # The body the app must forward instead of the client's: its output cap fitted.
        self.body: bytes | None = None

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
            content_type, content_encoding = content_headers(headers)
            self.observer = self._round.observe(
                self.admitted, status, content_type, content_encoding
            )
            if self._routed_by is not None:
                self.routed = self._routed_by(headers)
            headers.extend(self._added)
        return self._send(message)

    async def finish(self) -> None:
        """Charge the inference once, however the app ended (shielded). The app's own word on
        the model it routed to (``STATE_MODEL``) goes before its response's headers."""
        routed = self._state.get(STATE_MODEL)
        if not isinstance(routed, str) or not routed:
            routed = self.routed
        await self._round.finish(self.admitted, self.status, self.observer, routed)


async def admit_inference(
    round_: Round,
    identity: Identity | None,
    body: bytes | None,
    send: Send,
    *,
    route: str,
    dialect: Dialect,
    path_model: str | None,
    state: dict[str, Any],
    own: OwnHeaders | None,
    routed_by: RoutedBy | None = None,
    rewritable: bool = False,
    parties: Parties | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> Exchange | Refusal | None:
    """Admit one inference: ``None`` to pass it through unobserved, a refusal to send, or the
    exchange to hand the app as its ``send`` (its ``finish`` must then run, in ``finally``).

    ``body`` is None when it was not read (no identity: nothing to parse). ``rewritable``:
    the app has not read it yet, so a hard limit may fit its output cap (``exchange.body``).
    ``parties`` finds the request's end user and tags (in ``state``, ``headers`` or the body).
    """
    request: InferenceRequest | None = None
    if identity is not None and body is not None:
        try:
            budgets = round_.budgets
            request = parse_request(
                body, path_model, estimate_now=budgets is not None and budgets.config.enabled
            )
            if parties is not None:
                parties.apply(request, state, headers, body)
        except BadRequest as exc:
            return bad_request(dialect, exc)
    t0, inference_id = retry_of(state)
    fitted: list[bytes] = []
    fit = None if body is None or not rewritable else partial(_fit, body, fitted)
    outcome = await round_.admit(
        identity,
        request,
        route=route,
        dialect=dialect,
        t0=t0,
        inference_id=inference_id,
        fit=fit,
    )
    if isinstance(outcome, Admission):
        return None  # passed through: nothing was checked
    if isinstance(outcome, Refused):
        return _rendered(outcome, own)
    admission = outcome.admission
    decision = admission.decision
    assert decision is not None
    state[STATE_INFERENCE_ID] = decision.inference_id
    state[STATE_T0] = decision.t0
    state[STATE_RECORD_ID] = decision.record_id
    if outcome.lease is not None:
        state[STATE_PROVIDER_KEY] = outcome.lease
    added = [(_INFERENCE_ID_HEADER, decision.inference_id.encode())]
    if own is not None:
        added.extend(own(decision))
    added.extend(rate_limit_headers(decision))
    if outcome.budget is not None:
        added.extend(outcome.budget.headers)
    exchange = Exchange(round_, outcome, send, added, state, routed_by)
    if outcome.fitted is not None:
        exchange.body = fitted[-1]
        added.append((FIT_HEADER, str(outcome.fitted).encode()))
    return exchange


def _fit(body: bytes, fitted: list[bytes], cap: int) -> bool:
    """Whether ``body``'s output cap can be lowered to ``cap`` (the lowered body kept)."""
    lowered = with_output_cap(body, cap)
    if lowered is None:
        return False
    fitted.append(lowered)
    return True


def _rendered(refused: Refused, own: OwnHeaders | None) -> Refusal:
    """The refusal the round named, as a response; what the other parts took is given back
    once it is sent (or abandoned unsent)."""
    admission = refused.admission
    dialect = admission.dialect
    refusal: Refusal
    if refused.named is Named.BUDGET and refused.budget is not None:
        refusal = partial(send_budget_refusal, dialect, refused.budget)
    elif refused.named is Named.CAPACITY and refused.no_capacity is not None:
        refusal = partial(send_no_capacity, dialect, refused.no_capacity)
    elif refused.named is Named.POOL_DOWN:
        message = "The provider key pool could not be reached; retry shortly."
        refusal = partial(
            _send_error,
            dialect,
            503,
            "provider_pool_unavailable",
            message,
            retry_after=KINDS["provider_capacity"].outage_retry_after,
        )
    else:
        decision = admission.decision
        headers = own(decision) if own is not None and decision is not None else []
        refusal = partial(send_refusal, admission=admission, headers=headers)
    return _ThenGiveBack(refusal, refused)


class _ThenGiveBack:
    """A refusal that gives back what the round's other parts took once it is sent, or when
    it is abandoned unsent (``abandon``: the app had answered already). The client has its
    answer without waiting for that; it is done when the ASGI call ends."""

    __slots__ = ("_refusal", "_refused")

    def __init__(self, refusal: Refusal, refused: Refused) -> None:
        self._refusal, self._refused = refusal, refused

    async def __call__(self, send: Send) -> None:
        try:
            await self._refusal(send)
        finally:
            await self._refused.give_back()

    async def abandon(self) -> None:
        await self._refused.give_back()


async def abandon(refusal: Refusal) -> None:
    """Give back what a refusal that will not be sent holds (nothing, for most)."""
    if isinstance(refusal, _ThenGiveBack):
        await refusal.abandon()


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` for the app: first the body spendguard already consumed, then the real
    one (so the app still sees ``http.disconnect``)."""
    return _Replay(body, receive)


class _Replay:
    """``replay``'s receive: one slotted object rather than a closure and its cells, as it
    stays alive through the app call (see :class:`Exchange`)."""

    __slots__ = ("_body", "_receive")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        body = self._body
        if body is not None:
            self._body = None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()


def retry_of(state: dict[str, Any]) -> tuple[datetime | None, str | None]:
    """What the host app marked as the original inference of a retry or fallback (the engine
    decides whether to honour it)."""
    t0, inference_id = state.get(STATE_T0), state.get(STATE_INFERENCE_ID)
    if not isinstance(inference_id, str) or not isinstance(t0, datetime):
        return None, None
    return t0, inference_id
