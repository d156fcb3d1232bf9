"""The budgets engine: admit (reserve the estimate), finish (replace it by the actual usage)
or release, with no ASGI in sight.

Per request: the buckets that apply (the key's own budget or the fleet's per-key default, the
model's, the fleet's) each get the admission estimate reserved in one atomic call; the calls go
out together. If any bucket can't afford the request, the others' holds are returned and the
denial names the first failing window in config order, and within it the first scope in the
order key → model → global, unless the request's estimate alone exceeds some bucket's whole
limit: that denial, which no wait ends, is named first. The estimate is the prompt estimate
plus the output the spend limits reserve too (:mod:`spendguard.engine.reservation`: the
declared cap or the default, capped at the model's maximum; the section's
``default_output_tokens`` replaces the default), priced at the price table; a model without a
price reserves and counts tokens only, so cost limits don't apply to it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Final, Protocol

from .. import metrics
from ..budgets.config import BudgetsConfig, Scope, Storage, make_window, parse_budgets
from ..budgets.source import BudgetsSource
from ..clock import from_micros, to_micros, utcnow
from ..errors import LedgerUnavailable, StoreFull, StoreUnavailable
from ..identity import Identity, encode_id
from ..ledger import BudgetOverride, Ledger
from ..limits.kinds import KINDS
from ..limits.model import BudgetLimit, SubjectKind, Unit
from ..limits.rates import POLICY_FIELD, STATE_FIELD, TOKENS_UNIT
from ..limits.windows import PREPAID, Rolling
from ..record import InferenceRecord
from ..settings import UnknownModel
from ..store import MemoryStore, Store, make_store
from ..store.rolling import (
    Bucket,
    BucketCheck,
    Commit,
    Hold,
    Reserved,
    SeedSlice,
    WindowCheck,
    bucket_marks,
)
from ..usage import Usage
from .costing import DEFAULT_ENTRY
from .decision import Lasting
from .guard import new_record_id
from .overrides import CustomerBalances, OverrideCache
from .reservation import (
    DEFAULT_RESERVATION,
    OutputReservation,
    advice,
    describe_output,
    largest_fitting,
    usd,
)
from .singleflight import SingleFlight
from .stock import Shelf, Stock, fresh_ms

if TYPE_CHECKING:
    from ..settings import Settings
    from .carryover import Carryover
    from .decision import InferenceRequest
    from .guard import SpendGuard
    from .pricing import Price, PriceTable

log = logging.getLogger("spendguard.budgets")

_SCOPE_RANK = {
    SubjectKind.API_KEY: 0,
    SubjectKind.END_USER: 1,
    SubjectKind.TAG: 2,
    SubjectKind.CUSTOMER: 3,
    SubjectKind.MODEL: 4,
    SubjectKind.FLEET: 5,
}
_SCOPES = {scope.kind: scope for scope in Scope}
# Buckets every key shares, where a gateway may stock holds (engine/stock.py).
_SHARED: Final = frozenset(
    {SubjectKind.MODEL, SubjectKind.FLEET}
)  # a bucket's subject kind -> the YAML's name
OUTAGE_RETRY_AFTER = KINDS["budget"].outage_retry_after
# The budgets' names of the units, in 429 details and metric labels (as docs/budgets.md states).
UNIT_NAMES: Final = {Unit.TOKENS: "tokens", Unit.USD: "cost_micro_usd", Unit.REQUESTS: "requests"}
_MAX_PLANS = 10_000  # budget plans kept per gate; beyond, start over

EnsureConnected = Callable[[], Awaitable[None]]


class CounterLike(Protocol):
    def inc(self, amount: float = 1) -> None: ...


HEADER_LIMIT = b"x-budget-api-key-limit"
HEADER_REMAINING = b"x-budget-api-key-remaining"
HEADER_RESET = b"x-budget-api-key-reset"


class BudgetVerdict(StrEnum):
    ADMIT = "admit"
    DENY = "deny"  # 429 budget_exceeded
    UNAVAILABLE = "unavailable"  # Redis down and fail_open is false: 503, Retry-After: 5


@dataclass(frozen=True, slots=True)
class Denial:
    scope: Scope
    window: str
    unit: Unit
    limit: int
    model: str | None  # only for a per-model denial
    retry_after: int | None  # None: the request never fits as sent
    # The request's estimate (in ``unit``) when it alone exceeds the whole limit, and what it
    # is made of and what would fit.
    reserved: int | None = None
    explained: str = ""
    tag: str | None = None  # only for a per-tag denial: the tag, as the request carried it
    customer: str | None = None  # only for a per-customer denial: the request's customer

    def details(self) -> dict[str, object]:
        """What the 429 tells: the configured limit (and this request's own estimate), never
        anyone's usage."""
        out: dict[str, object] = {
            "scope": self.scope.value,
            "window": self.window,
            "unit": UNIT_NAMES[self.unit],
        }
        tokens = self.unit is not Unit.USD  # a count of tokens or requests
        out["limit" if tokens else "limit_micro_usd"] = self.limit
        if self.model is not None:
            out["model"] = self.model
        if self.tag is not None:
            out["tag"] = self.tag
        if self.customer is not None:
            out["customer"] = self.customer
        if self.reserved is not None:
            out["reserved" if tokens else "reserved_micro_usd"] = self.reserved
        return out

    @property
    def message(self) -> str:
        what = {
            Scope.PER_API_KEY: "API key",
            Scope.PER_END_USER: "End user",
            Scope.PER_TAG: f"Tag {self.tag!r}",
            Scope.PER_CUSTOMER: f"Customer {self.customer!r}",
            Scope.PER_MODEL: f"Model {self.model!r}",
            Scope.GLOBAL: "Global",
        }[self.scope]
        unit = {Unit.TOKENS: "token", Unit.REQUESTS: "request"}.get(self.unit, "cost")
        if self.window == PREPAID.id:
            return f"{what} prepaid balance exhausted: {usd(self.limit)} topped up, all used."
        if self.reserved is not None:
            limit = f"{self.limit:,} tokens" if self.unit is Unit.TOKENS else usd(self.limit)
            return (
                f"This request can never pass the {what} {unit} budget of {limit} for window "
                f"{self.window!r} as sent: {self.explained}"
            )
        return f"{what} {unit} budget exceeded for window {self.window!r}."


@dataclass(slots=True)
class BudgetAdmission:
    """One request's budgets: finished (or released) exactly once."""

    verdict: BudgetVerdict
    calls: tuple[BucketCheck, ...] = ()
    hold: Hold | None = None
    store: Store | None = None
    denial: Denial | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    model: str = ""
    count_cost: bool = False
    # The usage counters of every (bucket, window) it commits to: its plan's, bound once.
    counters: tuple[tuple[CounterLike, CounterLike], ...] = ()
    done: bool = False
    # A denial that a smaller output cap per completion would pass now (fitting on): that
    # cap; None otherwise.
    fits: int | None = None
    # It draws on a customer's prepaid account: priced as the ledger charges (BudgetGate.price).
    prepaid: bool = False
    # Its holds in the shared buckets were stocked ahead (engine/stock.py): their commit may
    # be carried by a later finishing round (engine/carryover.py).
    stocked: bool = False

    @property
    def allowed(self) -> bool:
        return self.verdict is BudgetVerdict.ADMIT

    @property
    def lasts(self) -> tuple[Lasting, int]:
        """How long this refusal lasts (see :class:`~spendguard.engine.decision.Lasting`)."""
        denial = self.denial
        if self.verdict is not BudgetVerdict.DENY or denial is None:
            return Lasting.OUTAGE, OUTAGE_RETRY_AFTER
        if denial.retry_after is None:
            return Lasting.AS_SENT, 0
        return Lasting.WAIT, denial.retry_after


def new_hold_id() -> str:
    """A hold's id, which is also the record id of the admission it is for (the spend
    limits' admission entry names it): one of theirs."""
    return new_record_id()


# A shared bucket's answer for a request that took a stocked hold there.
_STOCKED: Final = Reserved(True)


@dataclass(frozen=True, slots=True)
class _Stocked:
    """A request's dealings with its shared buckets' stock: the shelf, the calls it reserved
    in the round (its own only, when it took a stocked hold), and the refill sent with it."""

    shelf: Shelf
    reserved: tuple[BucketCheck, ...]
    refill: Awaitable[None] | None
    held: bool  # the gateway held (or was being granted) unused stock there when it was sent


@dataclass(frozen=True, slots=True)
class _Plan:
    """An identity and model's buckets under one section (and key override), made once."""

    config: BudgetsConfig
    calls: tuple[BucketCheck, ...]
    default_key: bool  # the key scope is the fleet's default: it reports headers
    longest_ms: int  # the longest window: how long the buckets' keys live, with the hold
    counters: tuple[tuple[CounterLike, CounterLike], ...]
    # The calls split: the model's and the fleet's buckets, shared by every key (a gateway
    # may stock holds there: engine/stock.py), and the request's own.
    shared: tuple[BucketCheck, ...] = ()
    own: tuple[BucketCheck, ...] = ()


class BudgetGate:
    """Budgets for one gateway process. ``source`` gives the live section (hot reload)."""

    def __init__(
        self,
        source: BudgetsSource,
        prices: PriceTable,
        *,
        redis_store: Store | None = None,
        owns_redis: bool = False,
        memory_store: Store | None = None,
        fallback_max_buckets: int = 10_000,
        overrides: OverrideCache | None = None,
        ledger: Ledger | None = None,
        ensure_connected: EnsureConnected | None = None,
        clock: Callable[[], datetime] = utcnow,
        output: OutputReservation = DEFAULT_RESERVATION,
        fit_min: int | None = None,
        ratelimit_fields: bool = False,
        fit_by_default: bool = True,
        balances: CustomerBalances | None = None,
        unknown_model: UnknownModel = UnknownModel.DEFAULT_PRICE,
        stock: Stock | None = None,
    ) -> None:
        self.source = source
        # Holds stocked ahead in the shared buckets (None: every request reserves there).
        self.stock = stock
        self.output = output  # the spend limits' own rule (the guard's), so the two agree
        self.ledger = ledger  # where a bucket Redis lost is rebuilt from
        # One rebuild per lost bucket at a time in this process; the others wait for it.
        self._rebuilding: SingleFlight[None] = SingleFlight()
        self._ensure_connected = ensure_connected
        self.prices = prices
        self.unknown_model = unknown_model  # the gateway's rule (see price)
        # The gateway's shared store (its Redis, closed with its guard), and the gate's own
        # in this process for ``storage: memory``.
        self.redis = redis_store
        self._owns_redis = owns_redis
        self.memory = memory_store if memory_store is not None else MemoryStore(clock=clock)
        # Fail open: what a replica admits while Redis is down, bounded (full: refused).
        self.fallback = MemoryStore(max_keys=fallback_max_buckets, clock=clock)
        self.overrides = overrides
        self.clock = clock
        # Fit instead of refuse: the least output cap a refused request may be fitted to
        # (None: off; the spend limits' setting, so the two agree).
        self.fit_min = fit_min
        self.fit_by_default = fit_by_default  # a limit without its own ``fit`` fits
        self.balances = balances  # customers' prepaid accounts (with a ledger)
        # The IETF RateLimit fields for the key's own token budget (the guard's setting).
        self.ratelimit_fields = ratelimit_fields
        self._warned_no_redis = False
        # Told of every bucket whose commit fired a threshold alert (the guard's alerts).
        self.on_alert: Callable[[Store, Bucket], None] | None = None
        # The usage counters' children by (scope, window id), bound once: window ids come
        # from the operator's file, a closed set.
        self._counted: dict[tuple[Scope, str], tuple[CounterLike, CounterLike]] = {}
        self._plans: dict[tuple[int, str, str | None, str, BudgetOverride | None], _Plan] = {}

    @property
    def config(self) -> BudgetsConfig:
        return self.source.current()

    def store_for(self, config: BudgetsConfig) -> Store:
        if config.storage is Storage.REDIS:
            if self.redis is not None:
                return self.redis
            if not self._warned_no_redis:
                self._warned_no_redis = True
                log.warning("budgets storage is redis but no Redis URL is set: counting in memory")
        return self.memory

    def _now_ms(self) -> int:
        return to_micros(self.clock()) // 1000

    # -- which buckets ----------------------------------------------------------------------
    def plan(
        self,
        config: BudgetsConfig,
        identity: Identity,
        model: str,
        override: BudgetOverride | None = None,
    ) -> tuple[tuple[BucketCheck, ...], bool]:
        """The buckets that apply, in scope order, and whether the key scope is the fleet
        default (the one that reports headers). ``override``: the key's own budget, if any."""
        calls: list[BucketCheck] = []
        default_key = False
        if identity.api_key is not None:
            subject = Bucket(SubjectKind.API_KEY, f"{identity.team}:{identity.api_key}")
            if override is not None:
                window = override_window(override)
                limit = BudgetLimit(tokens=override.max_tokens, alert_at=config.alert_at)
                calls.append(BucketCheck(subject, (WindowCheck(window, limit),)))
            elif config.per_api_key is not None:
                calls += _checked(subject, config.per_api_key, config.windows)
                default_key = bool(calls)
        model_limit = config.per_model.get(model)
        if model_limit is not None:
            model_bucket = Bucket(SubjectKind.MODEL, encode_id(model))
            calls += _checked(model_bucket, model_limit, config.windows)
        if config.global_ is not None:
            calls += _checked(Bucket(SubjectKind.FLEET, ""), config.global_, config.windows)
        return tuple(calls), default_key

    # -- admission --------------------------------------------------------------------------
    async def admit(self, identity: Identity, request: InferenceRequest) -> BudgetAdmission | None:
        """Reserve the request's estimate everywhere it applies; None when no budget applies
        (budgets off, or no scope covers this request): nothing to finish then."""
        return await self.begin(identity, request)

    def begin(
        self, identity: Identity, request: InferenceRequest, hold_id: str | None = None
    ) -> Awaitable[BudgetAdmission | None]:
        """:meth:`start` with the given hold id (a new one when None)."""
        return self.start(identity, request, hold_id or new_hold_id())[1]

    def start(
        self, identity: Identity, request: InferenceRequest, hold_id: str | None = None
    ) -> tuple[str, Awaitable[BudgetAdmission | None]]:
        """:meth:`admit`, with its store calls sent before this returns: on Redis they leave
        in the next pipeline write, together with the spend limits' preflight submitted in
        the same event-loop turn (one round trip for both). The result must be awaited.

        A key whose own budget this process has not read yet (or read too long ago) is read
        from the ledger first: its calls then leave later, on their own.

        Returns the hold's id with it, which the spend limits' admission entry names too
        (:meth:`recover`): ``hold_id``, or a stocked hold's (engine/stock.py) when the request
        takes one and ``hold_id`` is None; a new id when neither."""
        config = self.config
        # A customer's prepaid account applies whenever the section is on, limits or not.
        balances = self.balances if request.customer is not None and config.enabled else None
        if not config.active and balances is None:
            return hold_id or new_hold_id(), _no_budget()
        override: BudgetOverride | None = None
        if identity.api_key is not None and self.overrides is not None:
            known, override = self.overrides.peek(identity)
            if not known:
                hold_id = hold_id or new_hold_id()
                return hold_id, self._admit_read(config, identity, request, hold_id)
        topped: int | None = None
        if balances is not None:
            known, topped = balances.peek(encode_id(request.customer or ""))
            if not known:
                hold_id = hold_id or new_hold_id()
                return hold_id, self._admit_read(config, identity, request, hold_id)
        return self._begin(config, identity, request, override, hold_id, topped)

    async def _admit_read(
        self,
        config: BudgetsConfig,
        identity: Identity,
        request: InferenceRequest,
        hold_id: str,
    ) -> BudgetAdmission | None:
        override: BudgetOverride | None = None
        topped: int | None = None
        if identity.api_key is not None and self.overrides is not None:
            override = await self.overrides.get(identity)
        if request.customer is not None and self.balances is not None:
            topped = await self.balances.get(encode_id(request.customer))
        return await self._begin(config, identity, request, override, hold_id, topped)[1]

    def _begin(
        self,
        config: BudgetsConfig,
        identity: Identity,
        request: InferenceRequest,
        override: BudgetOverride | None,
        hold_id: str | None = None,
        topped: int | None = None,
    ) -> tuple[str, Awaitable[BudgetAdmission | None]]:
        model = request.model
        planned = self._planned(config, identity, model, override)
        if request.end_user is not None or request.tags or request.customer is not None:
            planned = self._with_parties(
                planned, identity, request.end_user, request.tags, request.customer, topped
            )
        calls = planned.calls
        if not calls:
            return hold_id or new_hold_id(), _no_budget()
        output = self.output.tokens(request, self.prices, config.default_output_tokens)
        estimate = Usage(input_tokens=request.estimated_input_tokens, output_tokens=output)
        prepaid = topped is not None
        price = self.price(model, prepaid=prepaid)
        cost = 0 if price is None else int(price.cost(estimate))
        now_ms = self._now_ms()
        hold_ms = config.hold_seconds * 1000
        hold = Hold(
            id=hold_id or "",
            now_ms=now_ms,
            expires_ms=now_ms + hold_ms,
            tokens=estimate.input_tokens + estimate.output_tokens,
            cost=cost,
            count_cost=price is not None,
            ttl_ms=planned.longest_ms + hold_ms,
        )
        store = self.store_for(config)
        seeded = self.ledger is not None
        stock, shelf, reserve, refill, held = self.stock, None, calls, None, False
        if stock is not None and planned.shared and store.shared:
            shelf = stock.shelf(config, model, planned.shared)
            held = shelf.holding()
            if hold_id is None:
                taken = stock.take(shelf, hold, fresh_ms(hold_ms))
                if taken is not None:
                    hold.id, reserve = taken, planned.own
        if not hold.id:
            hold.id = new_hold_id()
        reserving = store.reserve_buckets(reserve, hold, require_seed=seeded) if reserve else None
        if shelf is not None and stock is not None:
            # Sent after the request's own reserves (the same write): it sees them held.
            refill = stock.refill(shelf, store, hold, new_hold_id, fresh_ms(hold_ms), seeded)
        return hold.id, self._admitted(
            config,
            store,
            planned,
            hold,
            reserving,
            request,
            estimate,
            price is not None,
            prepaid,
            _Stocked(shelf, reserve, refill, held) if shelf is not None else None,
        )

    def _planned(
        self,
        config: BudgetsConfig,
        identity: Identity,
        model: str,
        override: BudgetOverride | None,
    ) -> _Plan:
        # The plan of an identity and model is the same until the section or the key's
        # override changes (a new object then): made once, kept (bounded) with what it is of.
        known = (id(config), identity.team, identity.api_key, model, override)
        planned = self._plans.get(known)
        if planned is None or planned.config is not config:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            calls, default_key = self.plan(config, identity, model, override)
            shared = tuple(c for c in calls if c.bucket.kind in _SHARED)
            planned = self._plans[known] = _Plan(
                config,
                calls,
                default_key,
                max((w.period_ms for c in calls for w in c.windows), default=0),
                self._counters(calls),
                shared,
                tuple(c for c in calls if c.bucket.kind not in _SHARED),
            )
        return planned

    def _with_parties(
        self,
        planned: _Plan,
        identity: Identity,
        end_user: str | None,
        tags: tuple[str, ...],
        customer: str | None,
        topped: int | None = None,
    ) -> _Plan:
        """``planned`` and the buckets of the request's end user (within its team), tags and
        customer that have limits: made per request (end users are many), after the key's
        bucket."""
        config = planned.config
        extra: list[BucketCheck] = []
        windows = config.windows
        if end_user is not None and config.per_end_user is not None:
            subject = f"{identity.team}:{encode_id(end_user)}"
            extra += _checked(Bucket(SubjectKind.END_USER, subject), config.per_end_user, windows)
        for tag in tags:
            limit = config.tag_limit(tag)
            if limit is not None:
                extra += _checked(Bucket(SubjectKind.TAG, encode_id(tag)), limit, windows)
        if customer is not None:
            bucket = Bucket(SubjectKind.CUSTOMER, encode_id(customer))
            limit = config.customer_limit(customer)
            found = [] if limit is None else _checked(bucket, limit, windows)
            own = found[0].checks if found else ()
            if topped is not None:  # its prepaid account: what was topped up, never draining
                own = (*own, WindowCheck(PREPAID, BudgetLimit(cost_micros=topped)))
            if own:
                extra.append(BucketCheck(bucket, own))
        if not extra:
            return planned
        calls = (*planned.calls, *extra)
        counters = (*planned.counters, *self._counters(tuple(extra)))
        longest = max(planned.longest_ms, config.longest_ms)
        mine = (*planned.own, *extra)
        return _Plan(config, calls, planned.default_key, longest, counters, planned.shared, mine)

    async def _admitted(
        self,
        config: BudgetsConfig,
        store: Store,
        planned: _Plan,
        hold: Hold,
        reserving: Awaitable[list[Reserved]] | None,
        request: InferenceRequest,
        estimate: Usage,
        count_cost: bool,
        prepaid: bool = False,
        stocked: _Stocked | None = None,
    ) -> BudgetAdmission:
        model, calls = request.model, planned.calls
        reserved = calls if stocked is None else stocked.reserved
        took_stock = False
        try:
            try:
                answers = await self._reserve(store, reserved, hold, model, reserving)
            finally:
                if stocked is not None and stocked.refill is not None:
                    await stocked.refill  # its replies came with the request's own
            if reserved is not calls:  # the shared buckets' holds were stocked: admitted there
                own = iter(answers)  # the request's own calls, in the plan's order
                answers = [_STOCKED if c.bucket.kind in _SHARED else next(own) for c in calls]
                took_stock = True
        except StoreFull:
            return self._tracker_full(calls, model)
        except (StoreUnavailable, ValueError) as exc:
            # ValueError: a script refused its input (a bug): a request gets the outage answer,
            # never a 500.
            if self.stock is not None:
                self.stock.forget()  # the stocked holds lapse with their expiry
            if not (store.shared and config.fail_open):
                log.warning("budget store unavailable, refusing (fail_open false): %s", exc)
                metrics.BUDGET_STORE_UNAVAILABLE.labels("refused").inc()
                return BudgetAdmission(BudgetVerdict.UNAVAILABLE)
            log.warning("budget store unavailable, counting locally (fail open): %s", exc)
            metrics.BUDGET_STORE_UNAVAILABLE.labels("fallback").inc()
            store = self.fallback
            try:
                answers = await store.reserve_buckets(calls, hold)
            except StoreFull:
                return self._tracker_full(calls, model)
        else:
            if stocked is not None and reserved is calls:
                answers = await self._unstocked(store, stocked, calls, answers, hold)
        admission = BudgetAdmission(
            BudgetVerdict.ADMIT,
            calls,
            hold,
            store,
            model=model,
            count_cost=count_cost,
            counters=planned.counters,
            prepaid=prepaid,
            stocked=took_stock,
        )
        denied = [(i, a) for i, a in enumerate(answers) if not a.ok]
        if denied:
            taken = [calls[i].bucket for i, a in enumerate(answers) if a.ok]
            if taken:
                await self._released(store.release_buckets(taken, hold.id))
            return self._deny(admission, denied, request, estimate)
        if planned.default_key:
            admission.headers = _key_headers(calls[0], answers[0], hold.now_ms)
        if self.ratelimit_fields and calls[0].bucket.kind is SubjectKind.API_KEY:
            fields = _key_fields(calls[0], answers[0], hold.now_ms)
            admission.headers = (*admission.headers, *fields)
        return admission

    async def _unstocked(
        self,
        store: Store,
        stocked: _Stocked,
        calls: tuple[BucketCheck, ...],
        answers: list[Reserved],
        hold: Hold,
    ) -> list[Reserved]:
        """A request reserved centrally and a shared bucket refused it while this gateway
        held unused stock there: the stock goes back (a refill on its way with it, once landed),
        no refill goes there for a while, and the refusing shared buckets are asked once more,
        so the stock never refuses what the limit would admit."""
        stock, shelf = self.stock, stocked.shelf
        again = [i for i, a in enumerate(answers) if not a.ok and calls[i].bucket.kind in _SHARED]
        if not again or stock is None:
            return answers
        dry = hold.now_ms + fresh_ms(hold.expires_ms - hold.now_ms)
        if not await stock.give_back(shelf, store, dry_until_ms=dry, held=stocked.held):
            return answers
        retried = await store.reserve_buckets([calls[i] for i in again], hold)
        answers = list(answers)
        for i, answer in zip(again, retried, strict=True):
            answers[i] = answer
        return answers

    async def _reserve(
        self,
        store: Store,
        calls: tuple[BucketCheck, ...],
        hold: Hold,
        model: str,
        reserving: Awaitable[list[Reserved]] | None,
    ) -> list[Reserved]:
        if reserving is None:
            return []
        answers = await reserving
        unseeded = [i for i, a in enumerate(answers) if a.unseeded]
        if unseeded:  # Redis lost these buckets: rebuild them, then ask them again
            lost = [calls[i] for i in unseeded]
            await self._rebuild(store, lost, model, hold)
            again = await store.reserve_buckets(lost, hold, require_seed=True)
            for i, answer in zip(unseeded, again, strict=True):
                answers[i] = answer
        return answers

    async def _rebuild(
        self, store: Store, calls: list[BucketCheck], model: str, hold: Hold
    ) -> None:
        """Seed buckets Redis lost (a restart, a flush) from the ledger's records instead of
        starting them from zero. A ledger that can't be read either: they start from zero.
        One rebuild per bucket at a time in this process; the others wait for it."""
        for call in calls:
            await self._rebuilding.do(
                call.bucket, partial(self._rebuild_one, store, call, model, hold)
            )

    async def _rebuild_one(self, store: Store, call: BucketCheck, model: str, hold: Hold) -> None:
        try:
            slices = await self._used_slices(call, model, hold.now_ms)
        except (LedgerUnavailable, TimeoutError) as exc:
            log.warning("budget bucket lost by Redis starts from zero (ledger: %r)", exc)
            slices = [[] for _ in call.windows]
        await store.seed_bucket(call, slices, hold.ttl_ms)
        log.info("budget bucket %s rebuilt from the ledger", scope_of(call.bucket).value)

    async def _used_slices(
        self, call: BucketCheck, model: str, now_ms: int
    ) -> list[list[SeedSlice]]:
        """Per window, the (slice, tokens, cost, requests) its bucket counted, from the
        records."""
        if self.ledger is None:
            return [[] for _ in call.windows]
        if self._ensure_connected is not None:
            await self._ensure_connected()
        bucket = call.bucket
        filters: dict[str, str] = {}
        if bucket.kind is SubjectKind.API_KEY:
            filters["team"], _, filters["api_key"] = bucket.subject.partition(":")
        elif bucket.kind is SubjectKind.END_USER:
            filters["team"], _, filters["end_user"] = bucket.subject.partition(":")
        elif bucket.kind is SubjectKind.TAG:
            filters["tag"] = bucket.subject
        elif bucket.kind is SubjectKind.CUSTOMER:
            filters["customer"] = bucket.subject
        elif bucket.kind is SubjectKind.MODEL:
            filters["model"] = model
        out = []
        # A customer's bucket with a prepaid account counted its requests at the ledger's
        # price (see price); the others' unpriced models, tokens only.
        prepaid = PREPAID in call.windows
        for window in call.windows:
            slice_ms = window.slice_ms
            # A prepaid window starts before the epoch: every record counts then.
            first = max(0, window.first_slice(now_ms) * slice_ms)
            rows = await self.ledger.used_slices(
                since=from_micros(first * 1000), slice_us=slice_ms * 1000, **filters
            )
            merged: dict[int, list[int]] = {}
            for row in rows:
                u = row.usage
                tokens = u.total_tokens
                price = self.price(row.model, prepaid=prepaid)
                cost = 0 if price is None else int(price.cost(u))
                entry = merged.setdefault(row.start_us // 1000 // slice_ms, [0, 0, 0])
                entry[0] += tokens
                entry[1] += cost
                entry[2] += row.requests
            out.append([(idx, t, c, r) for idx, (t, c, r) in sorted(merged.items())])
        return out

    def _deny(
        self,
        admission: BudgetAdmission,
        denied: list[tuple[int, Reserved]],
        request: InferenceRequest,
        estimate: Usage,
    ) -> BudgetAdmission:
        model = request.model
        never = self._never_fits(admission, request, estimate)
        if never is not None:
            denial = never
            scope, window = denial.scope, denial.window
        else:
            # The first failing window in config order; within it, the first scope.
            i, answer = min(
                denied,
                key=lambda d: (d[1].window, _SCOPE_RANK[admission.calls[d[0]].bucket.kind]),
            )
            call = admission.calls[i]
            check = call.checks[answer.window]
            limit = amount_of(check.limit, answer.unit)
            assert limit is not None  # a unit is only denied where it has a limit
            scope, window = scope_of(call.bucket), check.window.id
            denial = Denial(
                scope=scope,
                window=window,
                unit=answer.unit,
                limit=limit,
                model=model if scope is Scope.PER_MODEL else None,
                # A prepaid balance frees nothing by waiting: only a top-up.
                retry_after=None
                if check.window is PREPAID
                else max(1, -(-answer.retry_ms // 1000)),
                tag=_tag_of(call.bucket, request),
                customer=request.customer if scope is Scope.PER_CUSTOMER else None,
            )
        metrics.BUDGET_REJECTIONS.labels(scope.value, window).inc()
        admission.verdict = BudgetVerdict.DENY
        admission.denial = denial
        admission.done = True
        admission.fits = self._fits(
            [(admission.calls[i], a) for i, a in denied], request, estimate, admission.prepaid
        )
        return admission

    def _fits(
        self,
        denied: list[tuple[BucketCheck, Reserved]],
        request: InferenceRequest,
        estimate: Usage,
        prepaid: bool = False,
    ) -> int | None:
        """The largest output cap per completion that every refusing bucket has room for
        now, when fitting is on, the request declared a cap, and that cap is at least the
        minimum and below the declared one (design.md, "Fit instead of refuse")."""
        least = self.fit_min
        if least is None or request.max_tokens is None:
            return None
        if any(a.unit is Unit.REQUESTS for _, a in denied):
            return None  # a smaller answer is still one more request
        for call, _ in denied:
            for check in call.checks:
                fit = check.limit.fit
                if not (self.fit_by_default if fit is None else fit):
                    return None  # a budget that has not opted in refuses as sent
        tokens_in, choices = estimate.input_tokens, request.choices
        cap = estimate.output_tokens // choices
        price = self.price(request.model, prepaid=prepaid)
        for _, answer in denied:
            if answer.left_tokens is not None:
                cap = min(cap, (answer.left_tokens - tokens_in) // choices)
            if answer.left_cost is not None and price is not None:

                def cost_of(out: int, price: Price = price) -> int:
                    usage = Usage(input_tokens=tokens_in, output_tokens=out * choices)
                    return int(price.cost(usage))

                cap = min(cap, largest_fitting(cost_of, answer.left_cost, cap))
        return cap if least <= cap < estimate.output_tokens // choices else None

    def _never_fits(
        self, admission: BudgetAdmission, request: InferenceRequest, estimate: Usage
    ) -> Denial | None:
        """The denial of a bucket whose whole limit the estimate alone exceeds (no wait ends
        it), in the order of the others: window, then scope. Only a refused request gets
        here, so an admitted one pays nothing for it."""
        hold = admission.hold
        assert hold is not None
        found: tuple[tuple[int, int], BucketCheck, WindowCheck, Unit, int] | None = None
        for call in admission.calls:
            for w, check in enumerate(call.checks):
                if check.window is PREPAID:
                    continue  # used up, not too small: it says so as a balance
                tokens, cost = check.limit.tokens, check.limit.cost_micros
                if tokens is not None and hold.tokens > tokens:
                    unit, limit = Unit.TOKENS, tokens
                elif hold.count_cost and cost is not None and hold.cost > cost:
                    unit, limit = Unit.USD, cost
                else:
                    continue
                order = (w, _SCOPE_RANK[call.bucket.kind])
                if found is None or order < found[0]:
                    found = (order, call, check, unit, limit)
        if found is None:
            return None
        _, call, check, unit, limit = found
        tokens_in, output = estimate.input_tokens, estimate.output_tokens
        choices = request.choices
        made_of = f"{tokens_in:,} input and {describe_output(request, output, self.prices)}"
        if unit is Unit.TOKENS:
            reserved = hold.tokens
            explained = f"it reserves {reserved:,} tokens: {made_of}. "
            explained += advice(request, (limit - tokens_in) // choices)
        else:
            reserved = hold.cost
            price = self.price(request.model, prepaid=admission.prepaid)
            assert price is not None  # a cost is only counted for a priced model

            def cost_of(out: int) -> int:
                usage = Usage(input_tokens=tokens_in, output_tokens=out * choices)
                return int(price.cost(usage))

            explained = f"it reserves {usd(reserved)}: {made_of}. "
            explained += advice(request, largest_fitting(cost_of, limit, output // choices))
        scope = scope_of(call.bucket)
        return Denial(
            scope=scope,
            window=check.window.id,
            unit=unit,
            limit=limit,
            model=request.model if scope is Scope.PER_MODEL else None,
            retry_after=None,
            reserved=reserved,
            explained=explained,
            tag=_tag_of(call.bucket, request),
            customer=request.customer if scope is Scope.PER_CUSTOMER else None,
        )

    def _tracker_full(self, calls: tuple[BucketCheck, ...], model: str) -> BudgetAdmission:
        """A bounded tracker that can't take another bucket refuses like a budget would:
        never an admission nobody counts."""
        call = calls[0]
        check = call.checks[0]
        unit = next(u for u in Unit if amount_of(check.limit, u) is not None)
        limit = amount_of(check.limit, unit)
        scope = scope_of(call.bucket)
        log.error("budget tracker full: refusing a request it can't count")
        metrics.BUDGET_REJECTIONS.labels(scope.value, check.window.id).inc()
        denial = Denial(
            scope,
            check.window.id,
            unit,
            limit or 0,
            model if scope is Scope.PER_MODEL else None,
            OUTAGE_RETRY_AFTER,
        )
        return BudgetAdmission(BudgetVerdict.DENY, denial=denial, done=True)

    def price(self, model: str, *, prepaid: bool = False) -> Price | None:
        """What ``model`` is counted at: its price in the table; a model without one counts
        tokens only (None), except where the request draws on a customer's prepaid account:
        that is money, paid as the ledger charges it, so the gateway's unknown-model rule
        prices it there (the ``default`` entry; nothing with ``unknown_model=free``)."""
        price = self.prices.lookup(model)
        if price is None and prepaid and self.unknown_model is UnknownModel.DEFAULT_PRICE:
            price = self.prices.lookup(DEFAULT_ENTRY)
        return price

    # -- the end of a request -----------------------------------------------------------------
    async def finish(self, admission: BudgetAdmission, usage: Usage | None, model: str) -> None:
        """Replace the hold by ``usage`` (None: the request was refused, failed or cancelled:
        return the hold). Exactly once per admission; never raises."""
        await self.finish_soon(admission, usage, model)

    def finish_soon(
        self,
        admission: BudgetAdmission,
        usage: Usage | None,
        model: str,
        carry: Carryover | None = None,
    ) -> Awaitable[None]:
        """:meth:`finish`, its store calls sent before this returns (see :meth:`begin`): on
        Redis in the same pipeline write as the spend limits' postflight. Must be awaited.

        ``carry``: where the commit of holds stocked in the shared buckets waits for the next
        admission round (engine/carryover.py); the request's own buckets commit now."""
        if admission.done or admission.hold is None or admission.store is None:
            return _no_budget()
        admission.done = True
        hold, store = admission.hold, admission.store
        if usage is None:
            buckets = [c.bucket for c in admission.calls]
            return self._released(store.release_buckets(buckets, hold.id))
        tokens = usage.total_tokens
        cost = 0
        if admission.count_cost:
            price = self.prices.lookup(model) or self.price(
                admission.model, prepaid=admission.prepaid
            )
            cost = 0 if price is None else int(price.cost(usage))
        calls, counters = admission.calls, admission.counters
        if carry is not None and admission.stocked:
            # The shared buckets' commits wait to be carried, every bucket's together in one
            # call (engine/carryover.py); the usage counters count now.
            done = Commit(hold.id, hold.now_ms, tokens, cost)
            send_all = partial(self._commit_carried, store)
            own = []
            for call in calls:
                if call.bucket.kind in _SHARED:
                    # Grouped by the plan's check itself (by identity: hashing its value walks
                    # every window and limit of it). A waiting item holds the check, so its id
                    # is not reused meanwhile; a plan made again only starts a group of its own.
                    group = (id(store), id(call))
                    carry.add_to(group, (call, done, hold.ttl_ms), send_all, hold.id)
                else:
                    own.append(call)
            _count(counters, tokens, cost)
            if not own:
                return _no_budget()
            return self._commit(store, tuple(own), hold, tokens, cost, ())
        return self._commit(store, calls, hold, tokens, cost, counters)

    def _commit_carried(
        self, store: Store, carried: list[tuple[BucketCheck, Commit, int]]
    ) -> Awaitable[None]:
        """The carried commits of one bucket, sent as one call."""
        call = carried[0][0]
        ttl_ms = max(ttl for _, _, ttl in carried)
        commits = [done for _, done, _ in carried]
        sent = store.commit_holds(call, commits, now_ms=self._now_ms(), ttl_ms=ttl_ms)
        return self._carried_committed(store, call, sent)

    async def _carried_committed(
        self, store: Store, call: BucketCheck, sent: Awaitable[int]
    ) -> None:
        try:
            fired = await sent
        except Exception as exc:  # the responses are out; the holds expire by themselves
            log.warning("budget usage could not be recorded: %r", exc)
            fired = 1 if bucket_marks(call) is not None else 0  # it may have fired: look
        if fired and self.on_alert is not None:
            self.on_alert(store, call.bucket)

    def _commit(
        self,
        store: Store,
        calls: tuple[BucketCheck, ...],
        hold: Hold,
        tokens: int,
        cost: int,
        counters: tuple[tuple[CounterLike, CounterLike], ...],
    ) -> Awaitable[None]:
        """Replace ``hold`` in ``calls``' buckets by the usage, sent now; ``counters`` count
        it once it is in."""
        committing = store.commit_buckets(
            calls,
            hold.id,
            now_ms=self._now_ms(),
            at_ms=hold.now_ms,
            tokens=tokens,
            cost=cost,
            ttl_ms=hold.ttl_ms,
        )
        return self._committed(calls, store, committing, tokens, cost, counters)

    async def _committed(
        self,
        calls: tuple[BucketCheck, ...],
        store: Store,
        committing: Awaitable[list[int]],
        tokens: int,
        cost: int,
        counters: tuple[tuple[CounterLike, CounterLike], ...],
    ) -> None:
        try:
            fired = await committing
        except Exception as exc:  # the response is out; the hold expires by itself
            log.warning("budget usage could not be recorded: %r", exc)
            if self.on_alert is not None:
                # A commit may have run and fired with its reply lost: look on the next pass.
                for call in calls:
                    if bucket_marks(call) is not None:
                        self.on_alert(store, call.bucket)
            return
        if self.on_alert is not None and any(fired):
            for call, n in zip(calls, fired, strict=False):
                if n:
                    self.on_alert(store, call.bucket)
        _count(counters, tokens, cost)

    async def recover(self, record: InferenceRecord) -> None:
        """Count a dead gateway's admission, recovered from its admission entry as
        ``record``, in the buckets that still hold it (its hold id is the record id): the
        hold becomes what the record is charged, as the gateway's own commit would have made
        it. Where the hold is gone (committed before the gateway died, expired, or counted by
        an earlier recovery) nothing is counted, so an admission is counted once. Budgets on
        a store of this process's own (``storage: memory``, the outage fallback) died with
        the gateway: nothing to do."""
        config = self.config
        store = self.store_for(config)
        balances = self.balances if record.customer is not None and config.enabled else None
        if not (config.active or balances is not None) or not store.shared:
            return
        identity = record.identity
        override: BudgetOverride | None = None
        topped: int | None = None
        if identity.api_key is not None and self.overrides is not None:
            override = await self.overrides.get(identity)
        if balances is not None:
            topped = await balances.get(encode_id(record.customer or ""))
        planned = self._planned(config, identity, record.model, override)
        if record.end_user is not None or record.tags or record.customer is not None:
            planned = self._with_parties(
                planned, identity, record.end_user, record.tags, record.customer, topped
            )
        if not planned.calls:
            return
        usage = record.usage
        price = self.price(record.model, prepaid=topped is not None)
        cost = 0 if price is None else int(price.cost(usage))
        at_ms = to_micros(record.t0) // 1000
        fired = await store.commit_buckets(
            planned.calls,
            record.id,
            now_ms=self._now_ms(),
            at_ms=at_ms,
            tokens=usage.total_tokens,
            cost=cost,
            ttl_ms=planned.longest_ms + config.hold_seconds * 1000,
            held_only=True,
        )
        if self.on_alert is not None:
            for call, n in zip(planned.calls, fired, strict=False):
                if n:
                    self.on_alert(store, call.bucket)

    def _counters(
        self, calls: tuple[BucketCheck, ...]
    ) -> tuple[tuple[CounterLike, CounterLike], ...]:
        """The usage counters of each (bucket, window), bound once: window ids come from the
        operator's file, a closed set."""
        counted = self._counted
        out = []
        for call in calls:
            scope = scope_of(call.bucket)
            for window in call.windows:
                children = counted.get((scope, window.id))
                if children is None:
                    children = counted[(scope, window.id)] = (
                        metrics.BUDGET_USED.labels(scope.value, window.id, UNIT_NAMES[Unit.TOKENS]),
                        metrics.BUDGET_USED.labels(scope.value, window.id, UNIT_NAMES[Unit.USD]),
                    )
                out.append(children)
        return tuple(out)

    async def release(self, admission: BudgetAdmission | None) -> None:
        if admission is not None:
            await self.finish(admission, None, admission.model)

    @staticmethod
    async def _released(releasing: Awaitable[object]) -> None:
        try:
            await releasing
        except Exception as exc:  # the holds expire by themselves
            log.warning("budget holds could not be returned (they expire): %r", exc)

    async def return_stock(self) -> None:
        """Give back every stocked hold no request took (the gateway stops); never raises."""
        if self.stock is not None and self.redis is not None:
            await self.stock.give_all_back(self.redis)

    async def aclose(self) -> None:
        # The shared store is the gateway's, closed with its guard, unless the gate made it.
        if self.redis is not None and self._owns_redis:
            await self.redis.aclose()
        await self.memory.aclose()
        await self.fallback.aclose()


async def _no_budget() -> None:
    return None


def _count(counters: tuple[tuple[CounterLike, CounterLike], ...], tokens: int, cost: int) -> None:
    for tokens_used, usd_used in counters:
        tokens_used.inc(tokens)
        if cost:
            usd_used.inc(cost)


def _tag_of(bucket: Bucket, request: InferenceRequest) -> str | None:
    """The request's tag a tag bucket counts (None for any other bucket)."""
    if bucket.kind is not SubjectKind.TAG:
        return None
    return next((t for t in request.tags if encode_id(t) == bucket.subject), bucket.subject)


def _checked(bucket: Bucket, limit: BudgetLimit, windows: tuple[Rolling, ...]) -> list[BucketCheck]:
    """``bucket`` checked in every window where ``limit`` has amounts (none: not at all)."""
    checks = []
    for window in windows:
        amounts = limit.in_window(window.id)
        if amounts is not None:
            checks.append(WindowCheck(window, amounts))
    return [BucketCheck(bucket, tuple(checks))] if checks else []


def amount_of(limit: BudgetLimit, unit: Unit) -> int | None:
    """``limit``'s amount in ``unit`` (None: it has none)."""
    if unit is Unit.TOKENS:
        return limit.tokens
    if unit is Unit.USD:
        return limit.cost_micros
    return limit.requests if unit is Unit.REQUESTS else None


def scope_of(bucket: Bucket) -> Scope:
    """The section's name for a bucket's subject kind."""
    return _SCOPES[bucket.kind]


def override_window(override: BudgetOverride) -> Rolling:
    """A key's own window: named after its period (``24h``), separate from the fleet's."""
    return make_window(override.budget_window, override.budget_window)


def _key_headers(
    call: BucketCheck, answer: Reserved, now_ms: int
) -> tuple[tuple[bytes, bytes], ...]:
    """The key's own level in its tightest token window; none for a cost-only limit."""
    best: tuple[int, int, int] | None = None  # remaining, limit, reset
    for check, used in zip(call.checks, answer.used_tokens, strict=True):
        if check.limit.tokens is None:
            continue
        remaining = max(0, check.limit.tokens - used)
        reset = -(-check.window.reset_ms(now_ms) // 1000)
        if best is None or remaining < best[0]:
            best = (remaining, check.limit.tokens, reset)
    if best is None:
        return ()
    remaining, limit, reset = best
    return (
        (HEADER_LIMIT, str(limit).encode()),
        (HEADER_REMAINING, str(remaining).encode()),
        (HEADER_RESET, str(reset).encode()),
    )


def _key_fields(
    call: BucketCheck, answer: Reserved, now_ms: int
) -> tuple[tuple[bytes, bytes], ...]:
    """The IETF ``RateLimit-Policy`` / ``RateLimit`` items of the key's own token budget, one
    per window with a token limit (``key-tokens-<window>``): sent as fields of their own,
    beside the spend limits' (a Structured Field list may be split over several lines)."""
    policies: list[str] = []
    states: list[str] = []
    for check, used in zip(call.checks, answer.used_tokens, strict=True):
        limit = check.limit.tokens
        if limit is None:
            continue
        window = check.window
        name = f'"key-tokens-{window.id}"'
        policies.append(f'{name};q={limit};qu="{TOKENS_UNIT}";w={window.seconds}')
        left = -(-max(0, window.reset_ms(now_ms) - now_ms) // 1000)
        states.append(f"{name};r={max(0, limit - used)};t={left}")
    if not policies:
        return ()
    return ((POLICY_FIELD, ", ".join(policies).encode()), (STATE_FIELD, ", ".join(states).encode()))


def make_gate(
    source: BudgetsSource,
    prices: PriceTable,
    *,
    ledger: Ledger | None,
    override_ttl: float,
    fallback_max_buckets: int,
    memory_max_buckets: int,
    ensure_connected: EnsureConnected | None = None,
    clock: Callable[[], datetime] = utcnow,
    output: OutputReservation = DEFAULT_RESERVATION,
    store: Store | None = None,
    owned: bool = False,
    override_timeout: float = 5.0,
    fit_min: int | None = None,
    ratelimit_fields: bool = False,
    fit_by_default: bool = True,
    unknown_model: UnknownModel = UnknownModel.DEFAULT_PRICE,
    stock: Stock | None = None,
) -> BudgetGate:
    """A gate on the gateway's store: its Redis (shared by every replica, the calls leaving
    in the same pipeline writes as the spend limits') when it is one, used whenever the
    section says ``storage: redis``, also after a reload; one in this process always."""
    overrides = (
        OverrideCache(
            ledger,
            ttl=override_ttl,
            timeout=override_timeout,
            ensure_connected=ensure_connected,
        )
        if ledger is not None
        else None
    )
    balances = (
        CustomerBalances(
            ledger, ttl=override_ttl, timeout=override_timeout, ensure_connected=ensure_connected
        )
        if ledger is not None
        else None
    )
    return BudgetGate(
        source,
        prices,
        redis_store=store if store is not None and store.shared else None,
        owns_redis=owned,
        memory_store=MemoryStore(max_keys=memory_max_buckets, clock=clock),
        fallback_max_buckets=fallback_max_buckets,
        overrides=overrides,
        ledger=ledger,
        ensure_connected=ensure_connected,
        clock=clock,
        output=output,
        fit_min=fit_min,
        ratelimit_fields=ratelimit_fields,
        fit_by_default=fit_by_default,
        unknown_model=unknown_model,
        balances=balances,
        stock=stock,
    )


def gate_for(guard: SpendGuard) -> BudgetGate | None:
    """The budgets of the guard's settings; None when no budgets section is configured at
    all (then not even a file is watched). A section with ``enabled: false`` still gets a
    gate: enabling it in the file applies without a restart."""
    settings = guard.settings
    source = source_of(settings)
    if source is None:
        return None
    store, owned = guard.store, False
    if not store.shared and settings.redis_url is not None:
        # A guard given a store of its own in this process: budgets still count where the
        # settings say (storage: redis), on a store the gate owns.
        store, owned = make_store(settings, guard.clock), True
    return make_gate(
        source,
        guard.prices,
        ledger=guard.ledger,
        override_ttl=settings.policy_ttl,
        fallback_max_buckets=settings.fail_open_max_keys,
        memory_max_buckets=settings.memory_max_keys,
        # The guard connects its ledger at start; without a lifespan, on first use.
        ensure_connected=guard._ensure_connected,
        clock=guard.clock,
        output=guard.output,  # the spend limits' reservation rule: the two engines agree
        store=store,
        owned=owned,
        override_timeout=settings.db_timeout,
        fit_min=settings.fit_min_output_tokens,
        ratelimit_fields=settings.ratelimit_headers,
        fit_by_default=settings.fit_by_default,
        unknown_model=settings.unknown_model,
        stock=Stock(settings.budget_stock, settings.budget_stock_share)
        if settings.budget_stock and store.shared
        else None,
    )


def source_of(settings: Settings) -> BudgetsSource | None:
    """The settings' budgets section (its file, watched, or the section itself); None when
    there is none."""
    if settings.budgets_file is not None:
        return BudgetsSource.from_file(settings.budgets_file)
    if settings.budgets is not None:
        return BudgetsSource(parse_budgets(settings.budgets))
    return None


def recovery_gate(
    settings: Settings, prices: PriceTable, ledger: Ledger, store: Store
) -> BudgetGate | None:
    """The budgets a standalone worker closes recovered holds with (``spendguard settle``):
    the gateways' section, on their shared store; None without budgets."""
    source = source_of(settings)
    if source is None:
        return None
    return make_gate(
        source,
        prices,
        ledger=ledger,
        override_ttl=settings.policy_ttl,
        fallback_max_buckets=settings.fail_open_max_keys,
        memory_max_buckets=settings.memory_max_keys,
        store=store,
        override_timeout=settings.db_timeout,
        unknown_model=settings.unknown_model,
    )
