"""What the middleware and the deferred path both do around the app of an admitted inference:
hand it the body already read, and charge the inference once when it ends."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Coroutine, Generator
from functools import partial
from typing import Any, TypeVar

import anyio
from starlette.types import Message, Receive

from ..budgets import BudgetAdmission, BudgetGate
from ..engine.decision import Admission
from ..engine.guard import SpendGuard
from ..providers.model import Lease
from ..providers.routing import ProviderRouting
from ..usage import BodyObserver, Usage

__all__ = ["finish", "replay", "shielded"]

T = TypeVar("T")
log = logging.getLogger("spendguard")


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` for the app: first the body spendguard already consumed, then the real
    one (so the app still sees ``http.disconnect``)."""
    return _Replay(body, receive)


class _Replay:
    """``replay``'s receive: one slotted object rather than a closure and its cells, as it
    stays alive through the app call (see ``admission.Exchange``)."""

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


async def finish(
    guard: SpendGuard,
    budgets: BudgetGate | None,
    admission: Admission,
    status_code: int,
    observer: BodyObserver | None,
    budget: BudgetAdmission | None,
    routed: str | None = None,
    lease: Lease | None = None,
    providers: ProviderRouting | None = None,
) -> None:
    """Charge an admitted inference, however the app ended: return, exception, disconnect or
    cancellation. Shielded, so a cancelled request still settles its charge; bounded by the
    store's own timeouts, so no deadline of ours is needed. Its budget hold becomes what was
    charged, or is returned when nothing was; so does its provider lease. ``routed``: the
    model the app or its router says it routed to (``SpendGuard.finish``)."""
    if budgets is None:
        budget = None
    if providers is None:
        lease = None
    if budget is None and lease is None and guard.finishes_in_place:
        # The embedded store's charge does not suspend, and a cancellation can only land
        # where a coroutine suspends: no cancel scope is needed (it cost a few µs on every
        # request). shielded() still covers it should it ever suspend.
        await shielded(guard.finish(admission, status_code, observer, routed=routed))
        return
    with anyio.CancelScope(shield=True):
        if budget is None and lease is None:
            await guard.finish(admission, status_code, observer, routed=routed)
            return
        # The budget's commit and the lease's settlement leave with the postflight: one
        # round trip.
        alongside = partial(_alongside, budgets, budget, providers, lease)
        await guard.finish(admission, status_code, observer, routed=routed, alongside=alongside)
        if budget is not None and budgets is not None:
            await budgets.finish(budget, None, budget.model)  # a no-op unless not finished
        if lease is not None and providers is not None:
            await _quietly(providers.finish_soon(lease, None))  # likewise


def _alongside(
    budgets: BudgetGate | None,
    budget: BudgetAdmission | None,
    providers: ProviderRouting | None,
    lease: Lease | None,
    usage: Usage | None,
    model: str,
) -> Awaitable[None]:
    """The other checks' finishing calls, sent now; the result awaits them all."""
    parts: list[Awaitable[object]] = []
    if budget is not None and budgets is not None:
        parts.append(budgets.finish_soon(budget, usage, model))
    if lease is not None and providers is not None:
        used = None
        if usage is not None:
            used = usage.input_tokens + usage.output_tokens
            used += usage.cached_input_tokens + usage.cache_write_tokens
        parts.append(_quietly(providers.finish_soon(lease, used)))
    return _all(parts)


async def _all(parts: list[Awaitable[object]]) -> None:
    for part in parts:
        await part


async def _quietly(settling: Awaitable[object]) -> None:
    try:
        await settling
    except Exception as exc:  # the response is out; the lease lapses with its minute
        log.warning("provider lease could not be settled: %r", exc)


async def shielded(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result, run to its end even if the calling task is being cancelled.

    Its first step runs at once, outside any cancel scope: if it completes without
    suspending, no cancellation could have reached it. If it suspends, the rest runs inside a
    shielded scope, entered before this task yields to the event loop, so a cancellation
    delivered from then on waits until it ends. Only for work that enters no cancel scope of
    its own before it first suspends (anyio requires scopes to nest): the embedded store's
    charge enters none.
    """
    try:
        first = coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    with anyio.CancelScope(shield=True):
        result = await _Rest(coro, first)
    return result


class _Rest:
    """Awaiting this continues a coroutine already started by hand, from the value it first
    yielded: what ``await`` would have done had it not been started."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro, self._first = coro, first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._first
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task: the coroutine's to handle
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
