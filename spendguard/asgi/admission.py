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

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from typing import Any

from starlette.types import Message, Send

from ..budgets import BudgetAdmission, BudgetGate, BudgetVerdict
from ..engine.decision import Admission, InferenceRequest, Verdict
from ..engine.entries import admission_tokens
from ..engine.guard import SpendGuard
from ..identity import Identity
from ..providers.model import Lease, NoCapacity
from ..providers.routing import STATE_PROVIDER_KEY, ProviderRouting
from ..usage import BodyObserver, Dialect
from .errors import send_budget_refusal, send_error, send_no_capacity, send_refusal
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
log = logging.getLogger("spendguard")
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
        "_guard",
        "_routed_by",
        "_send",
        "_state",
        "admission",
        "budget",
        "lease",
        "observer",
        "providers",
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
        lease: Lease | None = None,
        providers: ProviderRouting | None = None,
    ) -> None:
        self._guard, self.admission, self.budget, self._added = guard, admission, budget, added
        self.lease, self.providers = lease, providers
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
            self._guard,
            budgets,
            self.admission,
            self.status,
            self.observer,
            self.budget,
            routed,
            self.lease,
            self.providers,
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
    providers: ProviderRouting | None = None,
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
    # The budgets' and the provider pool's calls are sent now and the spend limits' preflight
    # in this same event-loop turn: on Redis they leave in one pipeline write, one round trip
    # whatever is on (design.md, "One round trip each way").
    budget_soon: Awaitable[BudgetAdmission | None] | None = None
    lease_soon: Awaitable[Lease | NoCapacity] | None = None
    if identity is not None and request is not None:
        if budgets is not None:
            budget_soon = budgets.begin(identity, request)
        if providers is not None:
            tokens_in, tokens_out = admission_tokens(request, guard.coster.table, guard.output)
            lease_soon = providers.begin(request.model, identity, tokens_in + tokens_out)
    t0, inference_id = retry_of(state)
    try:
        admission = await guard.admit(
            identity,
            request,
            route=route,
            dialect=dialect,
            t0=t0,
            inference_id=inference_id,
            tentative=budget_soon is not None or lease_soon is not None,
        )
    finally:
        budget = await budget_soon if budget_soon is not None else None
        lease = await _leased(lease_soon) if lease_soon is not None else None
    if admission.verdict is Verdict.PASS:
        return None
    decision = admission.decision
    spend_allowed = admission.allowed and decision is not None
    budget_allowed = budget is None or budget.allowed
    if not (spend_allowed and budget_allowed and not isinstance(lease, NoCapacity | Exception)):
        return _refused(guard, budgets, providers, admission, budget, lease, dialect, remaining)
    assert decision is not None
    if budget_soon is not None or lease_soon is not None:
        guard.confirm(admission)
    state[STATE_INFERENCE_ID] = decision.inference_id
    state[STATE_T0] = decision.t0
    state[STATE_RECORD_ID] = decision.record_id
    if isinstance(lease, Lease):
        state[STATE_PROVIDER_KEY] = lease
    added = [(_INFERENCE_ID_HEADER, decision.inference_id.encode())]
    if remaining:
        added.extend(remaining_headers(decision))
    added.extend(rate_limit_headers(decision))
    if budget is not None:
        added.extend(budget.headers)
    if not isinstance(lease, Lease):
        lease = None
    return Exchange(guard, admission, budget, send, added, state, routed_by, lease, providers)


async def _leased(lease_soon: Awaitable[Lease | NoCapacity]) -> Lease | NoCapacity | Exception:
    try:
        return await lease_soon
    except Exception as exc:  # the pool's store could not decide: answered as an outage
        log.warning("provider pool unavailable: %r", exc)
        return exc


def _refused(
    guard: SpendGuard,
    budgets: BudgetGate | None,
    providers: ProviderRouting | None,
    admission: Admission,
    budget: BudgetAdmission | None,
    lease: Lease | NoCapacity | Exception | None,
    dialect: Dialect,
    remaining: bool,
) -> Refusal:
    """The answer when some check of the round refused. What the others took is given back
    after the answer is sent (the spend limits' admission withdrawn, the budget hold and the
    lease released). The answer names the spend limits' or the budget's refusal, whichever
    lasts longer, the budget's on a tie (design.md, "Which refusal is named"); a budget
    outage as it is; the provider pool's only when every limit admitted the request."""
    cleanup: list[Awaitable[object]] = []
    spend_allowed = admission.allowed and admission.decision is not None
    if spend_allowed:
        cleanup.append(guard.withdraw(admission))
    if budget is not None and budgets is not None and budget.allowed:
        cleanup.append(budgets.finish_soon(budget, None, budget.model))
    if isinstance(lease, Lease) and providers is not None:
        cleanup.append(providers.finish_soon(lease, None))
    refusal: Refusal
    if budget is not None and not budget.allowed:
        if (
            not spend_allowed
            and budget.verdict is BudgetVerdict.DENY
            and admission.lasts > budget.lasts
        ):
            refusal = _spend_refusal(admission, remaining)
        else:
            refusal = partial(send_budget_refusal, dialect, budget)
    elif not spend_allowed:
        refusal = _spend_refusal(admission, remaining)
    elif isinstance(lease, NoCapacity):
        refusal = partial(send_no_capacity, dialect, lease)
    else:
        message = "The provider key pool could not be reached; retry shortly."
        refusal = partial(
            _send_error, dialect, 503, "provider_pool_unavailable", message, retry_after=1
        )
    return _then(refusal, cleanup) if cleanup else refusal


def _spend_refusal(admission: Admission, remaining: bool) -> Refusal:
    decision = admission.decision
    headers = remaining_headers(decision) if remaining and decision is not None else []
    return partial(send_refusal, admission=admission, headers=headers)


def _then(refusal: Refusal, cleanup: list[Awaitable[object]]) -> Refusal:
    """``refusal``, then ``cleanup`` (what other checks of the round took, given back; sent
    already): the client has its answer without waiting for it, and it is done when the ASGI
    call ends. The cleanup is awaited even if sending fails; it never raises."""
    return _ThenGiveBack(refusal, cleanup)


class _ThenGiveBack:
    """A refusal that gives back what the round's other checks took once it is sent, or when
    it is abandoned unsent (``abandon``: the app had answered already)."""

    __slots__ = ("_cleanup", "_refusal")

    def __init__(self, refusal: Refusal, cleanup: list[Awaitable[object]]) -> None:
        self._refusal, self._cleanup = refusal, cleanup

    async def __call__(self, send: Send) -> None:
        try:
            await self._refusal(send)
        finally:
            await self.abandon()

    async def abandon(self) -> None:
        cleanup, self._cleanup = self._cleanup, []
        for done in cleanup:
            try:
                await done
            except Exception as exc:  # each part bounds and logs its own failures
                log.warning("spendguard could not give back a refused admission: %r", exc)


async def abandon(refusal: Refusal) -> None:
    """Give back what a refusal that will not be sent holds (nothing, for most)."""
    if isinstance(refusal, _ThenGiveBack):
        await refusal.abandon()


def retry_of(state: dict[str, Any]) -> tuple[datetime | None, str | None]:
    """What the host app marked as the original inference of a retry or fallback (the engine
    decides whether to honour it)."""
    t0, inference_id = state.get(STATE_T0), state.get(STATE_INFERENCE_ID)
    if not isinstance(inference_id, str) or not isinstance(t0, datetime):
        return None, None
    return t0, inference_id
