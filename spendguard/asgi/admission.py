"""The one admission sequence of an inference, for the middleware's own path and for the
``Depends(spendguard_guard)`` path alike: parse the body, hold budgets, admit spend limits
(returning the budget hold when they refuse; asking them anyway when a budget refuses, so the
longer refusal is named), and on success the response headers and the :class:`Exchange` that
observes and finishes the response.

Both paths call :func:`admit_inference` and get the same three outcomes: ``None`` (pass
through unobserved), a :data:`Refusal` to send, or an :class:`Exchange`. So they cannot
differ in checks, refusals or headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from typing import Any

from starlette.types import Message, Send

from ..budgets import BudgetAdmission, BudgetGate, BudgetVerdict
from ..budgets.responses import send_budget_refusal
from ..engine.decision import Admission, InferenceRequest, Verdict
from ..engine.guard import SpendGuard
from ..identity import Identity
from ..usage import BodyObserver, Dialect
from .errors import send_error, send_refusal
from .finishing import finish
from .ratelimit import rate_limit_headers
from .remaining import remaining_headers
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


async def _send_error(dialect: Dialect, status: int, code: str, message: str, send: Send) -> None:
    await send_error(send, dialect, status, code, message)


class Exchange:
    """An admitted inference's response as the app sends it: every message forwarded as it
    comes, its status and usage observed on the way, spendguard's headers added.

    One slotted object rather than a closure: each object a request keeps alive through the
    app call is walked by every garbage collection that runs meanwhile, and under load most of
    them are promoted to the oldest generation before they die.
    """

    __slots__ = (
        "_added",
        "_guard",
        "_routed_by",
        "_send",
        "_state",
        "admission",
        "budget",
        "observer",
        "routed",
        "status",
    )

    def __init__(
        self,
        guard: SpendGuard,
        admission: Admission,
        budget: BudgetAdmission | None,
        send: Send,
        added: list[tuple[bytes, bytes]],
        state: dict[str, Any],
        routed_by: RoutedBy | None = None,
    ) -> None:
        self._guard, self.admission, self.budget, self._added = guard, admission, budget, added
        self._send, self._state, self._routed_by = send, state, routed_by
        self.status = 0  # no response started (yet)
        self.observer: BodyObserver | None = None
        self.routed: str | None = None  # what the response's headers say was routed to

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
            self.observer = self._guard.observe(
                self.admission, status, content_type, content_encoding
            )
            if self._routed_by is not None:
                self.routed = self._routed_by(headers)
            headers.extend(self._added)
        return self._send(message)

    async def finish(self, budgets: BudgetGate | None) -> None:
        """Charge the inference once, however the app ended (shielded). The app's own word on
        the model it routed to (``STATE_MODEL``) goes before its response's headers."""
        routed = self._state.get(STATE_MODEL)
        if not isinstance(routed, str) or not routed:
            routed = self.routed
        await finish(
            self._guard, budgets, self.admission, self.status, self.observer, self.budget, routed
        )


async def admit_inference(
    guard: SpendGuard,
    budgets: BudgetGate | None,
    identity: Identity | None,
    body: bytes | None,
    send: Send,
    *,
    route: str,
    dialect: Dialect,
    path_model: str | None,
    state: dict[str, Any],
    remaining: bool,
    routed_by: RoutedBy | None = None,
) -> Exchange | Refusal | None:
    """Admit one inference: ``None`` to pass it through unobserved, a refusal to send, or the
    exchange to hand the app as its ``send`` (its ``finish`` must then run, in ``finally``).

    ``body`` is None when it was not read (no identity: nothing to parse).
    """
    request: InferenceRequest | None = None
    if identity is not None and body is not None:
        try:
            request = parse_request(body, path_model)
        except BadRequest as exc:
            return bad_request(dialect, exc)
    budget: BudgetAdmission | None = None
    if budgets is not None and identity is not None and request is not None:
        budget = await budgets.admit(identity, request)
        if budget is not None and not budget.allowed:
            return await _budget_refused(
                guard, budget, identity, request, route, dialect, state, remaining
            )
    t0, inference_id = retry_of(state)
    admission = await guard.admit(
        identity, request, route=route, dialect=dialect, t0=t0, inference_id=inference_id
    )
    if admission.verdict is Verdict.PASS:
        return None
    decision = admission.decision
    if not admission.allowed or decision is None:
        if budget is not None and budgets is not None:
            await budgets.release(budget)  # spend limits refused: return the hold
        headers = remaining_headers(decision) if remaining and decision is not None else []
        return partial(send_refusal, admission=admission, headers=headers)
    state[STATE_INFERENCE_ID] = decision.inference_id
    state[STATE_T0] = decision.t0
    state[STATE_RECORD_ID] = decision.record_id
    added = [(_INFERENCE_ID_HEADER, decision.inference_id.encode())]
    if remaining:
        added.extend(remaining_headers(decision))
    added.extend(rate_limit_headers(decision))
    if budget is not None:
        added.extend(budget.headers)
    return Exchange(guard, admission, budget, send, added, state, routed_by)


async def _budget_refused(
    guard: SpendGuard,
    budget: BudgetAdmission,
    identity: Identity,
    request: InferenceRequest,
    route: str,
    dialect: Dialect,
    state: dict[str, Any],
    remaining: bool,
) -> Refusal:
    """A budget refused: the spend limits are asked too (leaving nothing behind), and the
    answer names whichever refusal lasts longer, the budget's on a tie (design.md, "Which
    refusal is named"). A budget outage is answered as it is: its store is most likely the
    spend limits' too, and asking it again would only double the wait for a 503."""
    if budget.verdict is BudgetVerdict.DENY:
        t0, inference_id = retry_of(state)
        spend = await guard.refusal(
            identity, request, route=route, dialect=dialect, t0=t0, inference_id=inference_id
        )
        if spend is not None and spend.lasts > budget.lasts:
            decision = spend.decision
            headers = remaining_headers(decision) if remaining and decision is not None else []
            return partial(send_refusal, admission=spend, headers=headers)
    return partial(send_budget_refusal, dialect=dialect, admission=budget)


def retry_of(state: dict[str, Any]) -> tuple[datetime | None, str | None]:
    """What the host app marked as the original inference of a retry or fallback (the engine
    decides whether to honour it)."""
    t0, inference_id = state.get(STATE_T0), state.get(STATE_INFERENCE_ID)
    if not isinstance(inference_id, str) or not isinstance(t0, datetime):
        return None, None
    return t0, inference_id
