"""One admission round and one finishing round for every limit kind a gateway has.

An inference is checked by up to three parts, each planned from cached policies and each
sending its store calls before anything is awaited, so that on Redis they leave in one
pipeline write (one round trip; on a Cluster one write per node, in parallel):

- the spend limits, balances, rates and model lists (:class:`SpendGuard`, one script in the
  team's slot),
- the budgets' rolling windows (:class:`BudgetGate`, one script per bucket's slot),
- a provider key among the declared candidates (:class:`ProviderRouting`, one script in the
  pool's slot).

What is atomic is one script in one slot. When one part refuses after another admitted, the
round's answer names one refusal and :meth:`Refused.give_back` returns what the others took
(after the answer is sent, before the ASGI call ends): in between a concurrent request may be
refused at a limit it would have fitted, never admitted past one (design.md, "One round trip
each way"). Finishing is the mirror: the budget commit and the lease's settlement are sent
right before the spend limits' postflight, in the same write.

The ASGI layer (:mod:`spendguard.asgi.admission`) only parses, renders and observes; which
refusal is named and what is given back are decided here, once, for the middleware's own
path and the ``Depends`` path alike.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from functools import partial
from typing import Any, TypeVar

import anyio

from .. import metrics
from ..identity import Identity
from ..providers.model import Lease, NoCapacity
from ..providers.routing import ProviderRouting, settled_quietly
from ..usage import BodyObserver, Dialect, Usage
from .budgets import BudgetAdmission, BudgetGate, BudgetVerdict
from .decision import Admission, InferenceRequest, Verdict
from .denials import spend_denial_kind
from .entries import admission_tokens
from .guard import SpendGuard

T = TypeVar("T")
log = logging.getLogger("spendguard")

__all__ = ["Admitted", "Named", "Refused", "Round", "shielded"]


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True)
class Admitted:
    """An inference every part admitted: what each holds until it is finished, once."""

    admission: Admission
    budget: BudgetAdmission | None = None
    lease: Lease | None = None
    # The output cap per completion the request was fitted to (a hard limit or a budget
    # refused it as sent): the body the provider gets must say so. None: admitted as sent.
    fitted: int | None = None


class Named(StrEnum):
    """The part whose refusal a refused round answers with."""

    SPEND = "spend"  # a spend limit, the balance, a rate, a model list, identity or price
    BUDGET = "budget"  # a budget's window, or the budgets' store outage
    CAPACITY = "capacity"  # no candidate provider key has room
    POOL_DOWN = "pool_down"  # the provider pool's store could not decide


@dataclass(slots=True)
class Refused:
    """A round some part refused: the refusal it answers with (``named``, its part's own
    value beside it), and what the parts that admitted took, to give back once."""

    named: Named
    admission: Admission  # the spend limits' (refused, or admitted and withdrawn)
    budget: BudgetAdmission | None = None
    no_capacity: NoCapacity | None = None
    _taken: list[Awaitable[object]] = field(default_factory=list)

    async def give_back(self) -> None:
        """Return what the other parts took (sent already); never raises. Once."""
        taken, self._taken = self._taken, []
        for done in taken:
            try:
                await done
            except Exception as exc:  # each part bounds and logs its own failures
                log.warning("spendguard could not give back a refused admission: %r", exc)


def _denial_kind(refused: Refused) -> str | None:
    """What refused the round, for the recent denials (None: an outage, not a denial)."""
    if refused.named is Named.BUDGET:
        budget = refused.budget
        return "budget" if budget is not None and budget.verdict is BudgetVerdict.DENY else None
    if refused.named is Named.CAPACITY:
        return "capacity"
    if refused.named is Named.SPEND:
        return spend_denial_kind(refused.admission)
    return None


class Round:
    """A gateway's parts (spend limits always; budgets and provider keys when configured),
    admitted together and finished together."""

    __slots__ = ("budgets", "guard", "providers")

    def __init__(
        self,
        guard: SpendGuard,
        budgets: BudgetGate | None = None,
        providers: ProviderRouting | None = None,
    ) -> None:
        self.guard, self.budgets, self.providers = guard, budgets, providers

    async def admit(
        self,
        identity: Identity | None,
        request: InferenceRequest | None,
        *,
        route: str,
        dialect: Dialect,
        t0: datetime | None = None,
        inference_id: str | None = None,
        fit: Callable[[int], bool] | None = None,
    ) -> Admitted | Refused | Admission:
        """One inference's admission round: :class:`Admitted`, :class:`Refused`, or the spend
        limits' :class:`Admission` when nothing was checked (passed through unobserved).

        A refusal that a smaller output cap would pass (fitting on: every part that refused,
        a hard spend limit or a budget, says how small) gives back what the round took and is
        asked again, once, with that cap, if ``fit(cap)`` says the request can still be
        changed to it (the caller rewrites its body): admitted, the answer says what it was
        fitted to."""
        outcome = await self._round(identity, request, route, dialect, t0, inference_id)
        if not isinstance(outcome, Refused):
            return outcome
        fits = _fits(outcome)
        if fits is not None and request is not None and fit is not None and fit(fits):
            await outcome.give_back()
            again = await self._round(
                identity, request.capped(fits), route, dialect, t0, inference_id
            )
            if isinstance(again, Admitted):
                again.fitted = fits
                metrics.FITTED.inc()
                return again
            if isinstance(again, Refused):
                outcome = again
        if identity is not None:
            kind = _denial_kind(outcome)
            if kind is not None:
                model = request.model if request is not None else ""
                self.guard.denials.note(identity, kind, model)
        return outcome

    async def _round(
        self,
        identity: Identity | None,
        request: InferenceRequest | None,
        route: str,
        dialect: Dialect,
        t0: datetime | None,
        inference_id: str | None,
    ) -> Admitted | Refused | Admission:
        guard, budgets, providers = self.guard, self.budgets, self.providers
        budget_soon: Awaitable[BudgetAdmission | None] | None = None
        lease_soon: Awaitable[Lease | NoCapacity] | None = None
        record_id: str | None = None
        if identity is not None and request is not None:
            if budgets is not None:
                # One id for the budget hold and the spend limits' admission entry: a gateway
                # that dies with the request in flight leaves the entry, whose recovery turns
                # the hold into the recovered charge (design.md, "The hold model"). The gate
                # draws it: a hold stocked ahead in the shared buckets brings its own.
                record_id, budget_soon = budgets.start(identity, request)
            if providers is not None:
                tokens_in, tokens_out = admission_tokens(request, guard.coster.table, guard.output)
                lease_soon = providers.begin(request.model, identity, tokens_in + tokens_out)
        tentative = budget_soon is not None or lease_soon is not None
        try:
            admission = await guard.admit(
                identity,
                request,
                route=route,
                dialect=dialect,
                t0=t0,
                inference_id=inference_id,
                tentative=tentative,
                record_id=record_id,
            )
        finally:
            budget = await budget_soon if budget_soon is not None else None
            lease = await _leased(lease_soon) if lease_soon is not None else None
        if admission.verdict is Verdict.PASS:
            return admission  # no identity, and unidentified requests may pass
        spend_allowed = admission.allowed and admission.decision is not None
        if (
            spend_allowed
            and (budget is None or budget.allowed)
            and not isinstance(lease, NoCapacity | Exception)
        ):
            if tentative:
                guard.confirm(admission)
            return Admitted(admission, budget, lease if isinstance(lease, Lease) else None)
        return self._refused(admission, budget, lease)

    def _refused(
        self,
        admission: Admission,
        budget: BudgetAdmission | None,
        lease: Lease | NoCapacity | Exception | None,
    ) -> Refused:
        """The answer when some part refused. It names the spend limits' or the budget's
        refusal, whichever lasts longer, the budget's on a tie (design.md, "Which refusal is
        named"); a budget outage as it is; the provider pool's only when every limit admitted
        the request. What the others took is sent back now and awaited by ``give_back``."""
        taken: list[Awaitable[object]] = []
        spend_allowed = admission.allowed and admission.decision is not None
        if spend_allowed:
            taken.append(self.guard.withdraw(admission))
        if budget is not None and self.budgets is not None and budget.allowed:
            taken.append(self.budgets.finish_soon(budget, None, budget.model))
        if isinstance(lease, Lease) and self.providers is not None:
            taken.append(self.providers.finish_soon(lease, None))
        if budget is not None and not budget.allowed:
            spend_lasts = (
                not spend_allowed
                and budget.verdict is BudgetVerdict.DENY
                and admission.lasts > budget.lasts
            )
            named = Named.SPEND if spend_lasts else Named.BUDGET
            return Refused(named, admission, budget=budget, _taken=taken)
        if not spend_allowed:
            return Refused(Named.SPEND, admission, _taken=taken)
        if isinstance(lease, NoCapacity):
            return Refused(Named.CAPACITY, admission, no_capacity=lease, _taken=taken)
        return Refused(Named.POOL_DOWN, admission, _taken=taken)

    def observe(
        self,
        admitted: Admitted,
        status: int,
        content_type: str | None,
        content_encoding: str | None,
    ) -> BodyObserver | None:
        return self.guard.observe(admitted.admission, status, content_type, content_encoding)

    async def finish(
        self,
        admitted: Admitted,
        status_code: int,
        observer: BodyObserver | None,
        routed: str | None = None,
    ) -> None:
        """Charge an admitted inference, however the app ended: return, exception, disconnect
        or cancellation. Shielded, so a cancelled request still settles its charge; bounded by
        the store's own timeouts. Its budget hold becomes what was charged, or is returned
        when nothing was; so does its provider lease. ``routed``: the model the app or its
        router says it routed to (``SpendGuard.finish``)."""
        guard, admission = self.guard, admitted.admission
        budget = admitted.budget if self.budgets is not None else None
        lease = admitted.lease if self.providers is not None else None
        if budget is None and lease is None:
            if guard.finishes_in_place:
                # The embedded store's charge does not suspend, and a cancellation can only
                # land where a coroutine suspends: no cancel scope is needed. shielded() still
                # covers it should it ever suspend.
                await shielded(guard.finish(admission, status_code, observer, routed=routed))
                return
            with anyio.CancelScope(shield=True):
                await guard.finish(admission, status_code, observer, routed=routed)
            return
        with anyio.CancelScope(shield=True):
            # The budget's commit and the lease's settlement leave with the postflight: one
            # round trip.
            alongside = partial(self._alongside, budget, lease, admission)
            await guard.finish(admission, status_code, observer, routed=routed, alongside=alongside)
            if budget is not None and self.budgets is not None:
                await self.budgets.finish(budget, None, budget.model)  # a no-op unless unfinished
            if lease is not None and self.providers is not None:
                await settled_quietly(self.providers.finish_soon(lease, None))  # likewise

    def _alongside(
        self,
        budget: BudgetAdmission | None,
        lease: Lease | None,
        admission: Admission,
        usage: Usage | None,
        model: str,
    ) -> Awaitable[None]:
        """The other parts' finishing calls, sent now; the result awaits them all. Where the
        gateway has a carryover (engine/carryover.py), their writes to the shared slot (a
        stocked hold's commit, a lease's settlement) wait there instead, and this round
        carries every waiting one once enough wait: most finishing rounds then write to the
        team's slot alone."""
        parts: list[Awaitable[object]] = []
        carry = self.guard.carryover if usage is not None else None
        if budget is not None and self.budgets is not None:
            parts.append(self.budgets.finish_soon(budget, usage, model, carry))
        if lease is not None and self.providers is not None:
            used = None if usage is None else usage.total_tokens
            decision = admission.decision
            carried = (
                used is not None
                and carry is not None
                and decision is not None
                and self.providers.finish_later(lease, used, carry, decision.record_id)
            )
            if not carried:
                parts.append(settled_quietly(self.providers.finish_soon(lease, used)))
        if carry is not None:
            rider = carry.rider()
            if rider is not None:
                parts.append(rider)
        return _all(parts)


def _fits(refused: Refused) -> int | None:
    """The output cap every part that refused would admit the request at (None: some part
    refused for another reason than its size)."""
    admission, budget = refused.admission, refused.budget
    caps: list[int | None] = []
    if not (admission.allowed and admission.decision is not None):
        caps.append(admission.fits)
    if budget is not None and not budget.allowed:
        caps.append(budget.fits)
    if refused.no_capacity is not None or refused.named is Named.POOL_DOWN or not caps:
        return None
    if any(cap is None for cap in caps):
        return None
    return min(cap for cap in caps if cap is not None)


async def _leased(lease_soon: Awaitable[Lease | NoCapacity]) -> Lease | NoCapacity | Exception:
    try:
        return await lease_soon
    except Exception as exc:  # the pool's store could not decide: answered as an outage
        log.warning("provider pool unavailable: %r", exc)
        return exc


async def _all(parts: list[Awaitable[object]]) -> None:
    for part in parts:
        await part


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
