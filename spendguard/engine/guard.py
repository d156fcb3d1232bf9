"""The engine: it owns each inference, from admission to its record, with no ASGI in sight
(design.md, "One inference").

:class:`SpendGuard` is what the middleware drives; any gateway can drive it the same way::

    async with SpendGuard(settings) as guard:
        admission = await guard.admit(identity, request, route="/v1/chat/completions",
                                      dialect=Dialect.OPENAI)
        if admission.allowed:
            observer = guard.observe(admission, status_code, content_type, content_encoding)
            ...  # feed the response body to the observer as it passes
            await guard.finish(admission, status_code, observer)

``preflight`` and ``postflight`` are the two store steps underneath, usable on their own.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from datetime import datetime, timedelta
from functools import partial
from time import perf_counter, time_ns
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .. import metrics
from ..alerts import AlertService, marks_for
from ..clock import as_utc, to_micros, to_millis, utcnow
from ..errors import ConfigurationError, LedgerUnavailable, StoreFull, StoreUnavailable
from ..identity import Identity
from ..ledger import Ledger
from ..limits import KeyCodec, KeyPlan, Limit
from ..limits.kinds import KINDS
from ..limits.model import SubjectKind
from ..limits.rates import WINDOW_MS, RateDenial, RateState
from ..providers.model import ProviderKey
from ..providers.pool import ProviderPool
from ..record import InferenceRecord, PostflightStatus
from ..settings import FailMode, MissingIdentity, Settings, load_settings
from ..store import (
    EntryWrite,
    LimitState,
    MemoryStore,
    Outcome,
    OwnerLog,
    Preflight,
    Store,
    make_store,
)
from ..usage import BodyObserver, Dialect, Usage, estimate_usage, observer_for
from .admin import Admin, UsageReport
from .carryover import Carryover
from .costing import Coster
from .decision import Admission, Decision, InferenceRequest, Never, Unavailable, Verdict
from .denials import DenialLog
from .embedded import POSTGRES_WARNING, EmbeddedClaim, claim_sqlite
from .entries import admission_tokens, closed_entry, open_entry, worst_case
from .fill import CacheFiller
from .outage import OutageTracker
from .pricing import Price, PriceTable
from .recorder import Recorder
from .recovery import Recovery
from .reservation import OutputReservation, advice, describe_output, largest_fitting, usd
from .singleflight import SingleFlight
from .telemetry import admitted, decided, trace_guard
from .telemetry import charged as count_charge
from .worker import SettlementWorker

if TYPE_CHECKING:  # the budgets package builds on this one
    from .budgets import BudgetGate

log = logging.getLogger("spendguard")

_INFERENCE_ID = re.compile(r"[!-~]{1,64}")
_MAX_FILL_ROUNDS = 3  # a miss, a fill and a re-check; more means keys vanish as we fill them
# A gateway heartbeats 6 times per SPENDGUARD_OWNER_TTL; one silent for that long is dead and
# its admission entries are recovered by a settling worker (so a crash's records reach the
# ledger within about the TTL plus one settle interval).
_HEARTBEATS_PER_TTL = 6
_SHARED_LINGER = 0.1  # seconds the record writer waits for a batch to form (see __init__)
_EMBEDDED_LINGER = 0.025
_MAX_UNCLOSED = 100_000  # entries whose removal failed, kept for a retry (beyond: recovered)
_UNCLOSED_RETRY_SECONDS = 60.0
_CAP_FIELD = 10  # tokens an added `"max_completion_tokens": 10000000` is estimated at, at most
_MAX_WARNED = 1000  # model names warned about once each; beyond, no more lines
_DENIALS_INTERVAL = 1.0  # seconds between writes of the recent denials (off the request path)
_PREFLIGHT_SECONDS = metrics.PREFLIGHT_SECONDS
_POSTFLIGHT_SECONDS = metrics.POSTFLIGHT_SECONDS
_RELEASE_SECONDS = metrics.RELEASE_SECONDS
_random_bits = random.getrandbits


# The Retry-After of a 503 when the store can't decide (limits/kinds.py: one rule, per kind).
_OUTAGE_RETRY_AFTER = KINDS["spend_limit"].outage_retry_after


def new_record_id() -> str:
    """32 hex digits: the time in milliseconds (48 bits), then 80 random bits.

    Ids that grow with time keep the ledger's primary-key index appending at its right edge.
    Random ones (a uuid4) land on a random page each: once the index outgrows the cache, every
    row rewrites a page of its own (on SQLite a record cost 11 µs of CPU at an empty table and
    16 µs at 150,000 rows, against a flat 7 µs with these ids). Record ids need to be unique,
    not unguessable: ``random`` is seeded from the OS at start and re-seeded in a forked child,
    so replicas and workers draw different bits, 80 of them per millisecond.
    """
    return "%032x" % (time_ns() // 1_000_000 << 80 | _random_bits(80))


def charged(status_code: int) -> bool:
    """Only successful responses are charged: an upstream error costs the caller nothing."""
    return 200 <= status_code < 300


# Encoded prices by the Price object's id, the object kept beside its text so the id cannot
# be reused while it is here. Every record carries its price, and encoding one (or hashing
# it by value, its Decimals) costs a request far more than this lookup: a table hands out
# the same few objects again and again.
_PRICE_TEXTS: dict[int, tuple[Price, str]] = {}
_PRICE_TEXTS_MAX = 4096  # tables swapped at run time leave their objects behind; start over


def _price_text(price: Price | None) -> str:
    """``price`` as a record carries it ('' for none: the model is charged nothing)."""
    if price is None:
        return ""
    known = _PRICE_TEXTS.get(id(price))
    if known is not None and known[0] is price:
        return known[1]
    text = price.encode()
    if len(_PRICE_TEXTS) >= _PRICE_TEXTS_MAX:
        _PRICE_TEXTS.clear()
    _PRICE_TEXTS[id(price)] = (price, text)
    return text


class SpendGuard:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        store: Store | None = None,
        ledger: Ledger | None = None,
        prices: PriceTable | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.settings = settings if settings is not None else load_settings()
        s = self.settings
        self.clock = clock
        self.codec = KeyCodec(s.key_prefix, timedelta(seconds=s.key_grace))
        self.store: Store = store if store is not None else make_store(s, clock)
        self._owns_store = store is None  # a store the caller gave stays the caller's
        self.outage = OutageTracker(s.fail_open_max_keys)
        self._fail_open = s.fail_mode is FailMode.OPEN
        self.ledger = ledger if ledger is not None else Ledger(s.database_url.get_secret_value())
        self.prices = prices if prices is not None else PriceTable.load(s.prices)
        self.coster = Coster(self.prices, s.unknown_model)
        # What a request reserves for its output: the one rule of hard limits, rates and
        # budgets (the budget gate is given the same object).
        self.output = OutputReservation.of(
            s.default_output_tokens, s.default_output_tokens_by_model
        )
        self.recorder = Recorder(
            self.ledger,
            capacity=s.record_buffer,
            on_written=self._records_written,
            linger=_EMBEDDED_LINGER,  # a shared store's at start
        )
        # Admission entries (a shared store only: an embedded store dies with its records).
        self.owner = f"{random.getrandbits(64):016x}"
        self._owners: OwnerLog | None = None  # set at start for a shared store
        self._entries_on = False  # while this process's heartbeat is current
        self._entry_teams: set[str] = set()  # teams listed under this owner
        self._registering: SingleFlight[None] = SingleFlight()
        # Entries to remove again: entries key -> record id -> since when (monotonic).
        self._unclosed: dict[str, dict[str, float]] = {}
        self._unreleased: list[Decision] = []  # uncharged admissions whose release failed
        self._unpriced_routes: set[str] = set()  # routed models warned about (bounded)
        self.worker = SettlementWorker(
            self.ledger,
            self.store,
            self.coster,
            self.codec,
            batch_size=s.settle_batch,
            settle=s.run_worker,
            clock=clock,
        )
        self.filler = CacheFiller(
            self.ledger,
            self.store,
            self.codec,
            policy_ttl=s.policy_ttl,
            db_timeout=s.db_timeout,
            ensure_connected=self._ensure_connected,
            policy_stale_max=s.policy_stale_max,
            on_filled=self.worker.note_filled,
        )
        # Threshold alerts: fired by the postflight script, moved and sent off the request path.
        self._thresholds = s.alert_thresholds
        self._projected = s.alert_projected
        self.alerts = AlertService.from_settings(
            s,
            self.ledger,
            self.store,
            self.codec,
            clock=clock,
            usage=self._usage_of if s.alert_projected else None,
        )
        self.alerts.active = bool(self._thresholds or self._projected)
        self.denials = DenialLog(self.ledger, clock)  # recent denials, for reports
        # The budgets checked beside these limits, when the gateway has any (set by the
        # middleware): recovery closes their holds with the admission entries.
        self.budgets: BudgetGate | None = None
        # Finishing writes to the shared slot, carried by one finishing round in eight: set at
        # start for a shared store (in this process nothing leaves, so nothing needs to wait).
        self.carryover: Carryover | None = None
        self._pool: ProviderPool | None = None
        self._stack: AsyncExitStack | None = None
        self._cancel: anyio.CancelScope | None = None
        self._claim: EmbeddedClaim | None = None  # held from start to stop (embedded store)
        # Set when start found another process counting on this ledger: every preflight then
        # refuses, since without a lifespan the app serves on after a failed start.
        self._refused = False
        self._stopped = anyio.Event()
        self._connect_lock = anyio.Lock()
        trace_guard(self, s.otel)  # spans around preflight/postflight, if enabled

    @property
    def pool(self) -> ProviderPool:
        """The provider-key pool beside this guard's store (on its Redis client, or in this
        process): register keys here; ``provider_candidates`` lease from it at admission."""
        if self._pool is None:
            self._pool = ProviderPool.beside(self.store, clock=self.clock)
        return self._pool

    def _usage_of(self, team_id: str) -> Awaitable[UsageReport]:
        return self.admin.usage(team_id)

    async def _close_budget_hold(self, record: InferenceRecord) -> None:
        """Recovery's hook: a recovered admission's budget hold becomes its charge."""
        if self.budgets is not None:
            await self.budgets.recover(record)

    @property
    def admin(self) -> Admin:
        """Policies, balances and usage, with this process's cache kept in sync."""
        return Admin(
            self.ledger,
            self.store,
            self.codec,
            policy_ttl=self.settings.policy_ttl,
            clock=self.clock,
        )

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Background tasks are up (the ASGI lifespan ran, or ``start()`` was called)."""
        return self._cancel is not None

    @property
    def finishes_in_place(self) -> bool:
        """Whether :meth:`finish` runs to its end without suspending: the embedded store
        answers in place and a record goes to the writer's queue, so nothing in it awaits I/O
        (before the lifespan runs it does: the record is then written through). The store's
        exact class: a subclass may await."""
        return self.running and type(self.store) is MemoryStore

    async def _ensure_connected(self) -> None:
        if self.ledger.connected:
            return
        async with self._connect_lock:
            if not self.ledger.connected:
                # Bounded: without a lifespan this runs on a request (TimeoutError -> 503).
                with anyio.fail_after(self.settings.db_timeout):
                    await self.ledger.connect()
                    await self.ledger.init_schema()

    async def start(
        self, *, task_group: TaskGroup | None = None, worker: bool | None = None
    ) -> None:
        """Connect, create the schema if needed, start the record writer and the worker.

        The tasks run in ``task_group`` (the middleware passes the lifespan's) or in a task
        group of the guard's own; ``stop()`` ends them either way.
        """
        if self._cancel is not None:
            raise ConfigurationError("SpendGuard already started")
        claim = self._claim_ledger()
        try:
            await self._start(task_group, worker)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        self._claim = claim

    def _claim_ledger(self) -> EmbeddedClaim | None:
        """The embedded store counts in this process only: make sure no other process runs
        one on the same ledger (design.md, "One process per embedded store")."""
        if self.store.shared:
            return None
        path = self.ledger.sqlite_path
        if path is None:
            if self.ledger.is_postgres:
                log.warning(POSTGRES_WARNING)
            return None  # in-memory SQLite: the ledger itself is this process's
        try:
            claim = claim_sqlite(path)
        except ConfigurationError:
            self._refused = True
            raise
        self._refused = False
        return claim

    async def _start(self, task_group: TaskGroup | None, worker: bool | None) -> None:
        await self._ensure_connected()
        await self.store.start()
        if self.store.shared and self.carryover is None:
            self.carryover = Carryover()
        if self.settings.provider_keys:
            keys = [ProviderKey(**k) for k in self.settings.provider_keys]  # type: ignore[arg-type]
            await self.pool.register(*keys)
        store = self.store
        if store.shared and isinstance(store, OwnerLog):
            self._owners = store
            # A record waiting for its batch is durable already (its closed admission entry),
            # so the writer waits longer for bigger batches: a row costs the event loop about
            # half as much in a batch of 100 as in one of 20. Without entries what waits is
            # lost with the process, so it waits less.
            self.recorder.linger = _SHARED_LINGER
            self.worker.recovery = Recovery(
                self.ledger,
                store,
                store,
                self.codec,
                self.coster,
                me=self.owner,
                holds=self._close_budget_hold,
            )
        if task_group is None:
            self._stack = AsyncExitStack()
            task_group = await self._stack.enter_async_context(anyio.create_task_group())
        self._stopped = anyio.Event()
        self._cancel = await task_group.start(self._background, worker is not False)

    async def _background(
        self, run_worker: bool, *, task_status: TaskStatus[anyio.CancelScope]
    ) -> None:
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    await tg.start(self.recorder.run)
                    await tg.start(self.denials.run, _DENIALS_INTERVAL)
                    if self._owners is not None:
                        await tg.start(self._heartbeat)
                    if run_worker:
                        await tg.start(self.worker.run, self.settings.settle_interval)
                    # Always: a limit can carry thresholds of its own (the service idles
                    # until one fires).
                    await tg.start(self.alerts.run, self.settings.alert_interval)
                    task_status.started(scope)
        finally:
            self._entries_on = False
            self._stopped.set()

    async def _heartbeat(self, *, task_status: TaskStatus[None]) -> None:
        """Keep this process marked alive while it runs, so nobody recovers the admission
        entries of its inferences in flight. Entries are written only while the mark is
        current: a process nobody knows to be alive must not leave entries behind."""
        assert self._owners is not None
        owners, codec = self._owners, self.codec
        alive_key = codec.owner_alive_key(self.owner)
        ttl_ms = int(self.settings.owner_ttl * 1000)
        started = False
        while True:
            try:
                await owners.heartbeat(codec.owners_key(), alive_key, self.owner, ttl_ms)
                if not self._entries_on and self._entry_teams:
                    # The mark lapsed (an outage, a long pause): a recovery may have dropped
                    # this owner's list of teams, so list them again.
                    for team in sorted(self._entry_teams):
                        await owners.add_member(codec.owner_teams_key(self.owner), team)
                self._entries_on = True
            except StoreUnavailable as exc:
                self._entries_on = False
                log.warning("spendguard heartbeat failed (no admission entries): %s", exc)
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(self.settings.owner_ttl / _HEARTBEATS_PER_TTL)

    async def _register(self, team: str) -> None:
        assert self._owners is not None
        await self._owners.add_member(self.codec.owner_teams_key(self.owner), team)
        self._entry_teams.add(team)

    async def _records_written(self, records: list[InferenceRecord]) -> None:
        """The ledger has these records: their admission entries go (one call per team),
        once the writes carried for them have landed (engine/carryover.py)."""
        carry = self.carryover
        if carry is not None and carry.waiting(r.id for r in records):
            with anyio.move_on_after(self.settings.redis_timeout * 2):
                await carry.settle()
        if self._unreleased:
            retry, self._unreleased = self._unreleased, []
            for decision in retry:
                await self._release(decision)
        if self._owners is None:
            return
        by_key: dict[str, list[str]] = {key: list(ids) for key, ids in self._unclosed.items()}
        for record in records:
            by_key.setdefault(self.codec.entries_key(record.identity.team), []).append(record.id)
        if not any(by_key.values()):
            return
        try:
            await self.store.close_entries(by_key)
        except StoreUnavailable as exc:
            # Kept for the next batch; beyond the bound a recovery removes them after this
            # process is gone (its records are in the ledger: recovering them writes nothing).
            log.warning("spendguard could not remove admission entries: %s", exc)
            if sum(len(ids) for ids in self._unclosed.values()) < _MAX_UNCLOSED:
                self._note_unclosed(
                    {r.id: self.codec.entries_key(r.identity.team) for r in records}
                )
            return
        # A removal that failed is sent again with every batch for a while: a Redis that was
        # paused runs the calls it had queued once it resumes, possibly after our first retry.
        cutoff = anyio.current_time() - _UNCLOSED_RETRY_SECONDS
        for key in list(self._unclosed):
            kept = {rid: at for rid, at in self._unclosed[key].items() if at > cutoff}
            if kept:
                self._unclosed[key] = kept
            else:
                del self._unclosed[key]

    def _note_unclosed(self, ids: dict[str, str]) -> None:
        """Remember entries (record id -> entries key) whose removal must be sent again."""
        now = anyio.current_time()
        for rid, key in ids.items():
            self._unclosed.setdefault(key, {}).setdefault(rid, now)

    async def stop(self) -> None:
        """Stop taking work, flush the records (shielded, bounded), disconnect and release the
        ledger (the embedded store's claim)."""
        claim, self._claim = self._claim, None
        try:
            await self._stop()
        finally:
            if claim is not None:
                claim.release()

    async def _stop(self) -> None:
        cancel, stack = self._cancel, self._stack
        self._cancel = self._stack = None
        if cancel is not None:
            cancel.cancel()
        if stack is not None:
            # Our own task group: closing it waits for the background tasks. It must be exited
            # outside any scope opened after it, hence before the shielded block below.
            await stack.aclose()
        with anyio.CancelScope(shield=True):
            if cancel is not None:
                await self._stopped.wait()
            if self.carryover is not None:
                # What waited for a finishing round to carry it leaves now.
                with anyio.move_on_after(self.settings.redis_timeout * 2):
                    await self.carryover.settle()
            with anyio.move_on_after(10):
                try:
                    await self.recorder.flush()
                except LedgerUnavailable as exc:
                    log.error(
                        "spendguard lost %d unwritten records at shutdown: %s",
                        self.recorder.pending,
                        exc,
                    )
            with anyio.move_on_after(self.settings.db_timeout):
                with suppress(LedgerUnavailable):
                    await self.denials.flush()
            if self.alerts.active:
                with anyio.move_on_after(self.settings.db_timeout):
                    await self.alerts.run_once()  # what this process fired, into the outbox
            if self._owners is not None:
                # Whatever is still in an entry (the database was down) is recovered by
                # another process's worker from now on, instead of after the owner TTL.
                with anyio.move_on_after(self.settings.redis_timeout * 2):
                    with suppress(StoreUnavailable):
                        await self._owners.delete(self.codec.owner_alive_key(self.owner))
            await self.ledger.disconnect()
            if self.budgets is not None:
                # Holds stocked ahead and never taken go back now instead of lapsing.
                with anyio.move_on_after(self.settings.redis_timeout * 2):
                    await self.budgets.return_stock()
            if self._owns_store and self.store.shared:
                # Its connections, not its state (Redis keeps that): a guard started again
                # connects again. The embedded store is left as it is: its state is in here.
                with anyio.move_on_after(self.settings.redis_timeout * 2):
                    await self.store.aclose()

    async def __aenter__(self) -> SpendGuard:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- one inference --------------------------------------------------------------------
    async def admit(
        self,
        identity: Identity | None,
        request: InferenceRequest | None,
        *,
        route: str,
        dialect: Dialect,
        t0: datetime | None = None,
        inference_id: str | None = None,
        tentative: bool = False,
        record_id: str | None = None,
    ) -> Admission:
        """Decide whether one inference may call the provider.

        ``request`` may be None only when there is no identity (the body is not read then).
        ``t0`` and ``inference_id`` continue an earlier inference (a retry or fallback).
        ``record_id``: the id its record and admission entry get (a new one when None); the
        round gives it when another part holds under the same id.
        ``tentative``: checks of other slots decide in the same round; an admission is then
        not counted until :meth:`confirm`, or taken back by :meth:`withdraw`.
        """
        if identity is None:
            verdict = (
                Verdict.PASS
                if self.settings.missing_identity is MissingIdentity.ALLOW
                else Verdict.UNAUTHENTICATED
            )
            admitted(verdict)
            return Admission(verdict, route, dialect)
        if request is None:
            raise TypeError("admit() needs the request of an identified inference")
        if self.coster.rejects_unknown and not self.coster.is_priced(request.model):
            return self._unpriced(request, route, dialect)
        now = self.clock()
        t0, inference_id = self._continued(now, t0, inference_id)
        decision = await self.preflight(
            identity,
            t0,
            inference_id=inference_id,
            request=request,
            route=route,
            now=now,
            tentative=tentative,
            record_id=record_id,
        )
        if request.end_user is not None or request.tags or request.customer is not None:
            decision.end_user, decision.tags = request.end_user, request.tags
            decision.customer = request.customer
        if decision.verdict is not Verdict.DENY:
            return Admission(decision.verdict, route, dialect, request, decision)
        return self._denied(request, decision, route, dialect)

    def _unpriced(self, request: InferenceRequest, route: str, dialect: Dialect) -> Admission:
        self.coster.refused(request.model)
        message = f"Model {request.model!r} has no price."
        admitted(Verdict.UNPRICED)
        return Admission(Verdict.UNPRICED, route, dialect, request, message=message)

    def _denied(
        self, request: InferenceRequest, decision: Decision, route: str, dialect: Dialect
    ) -> Admission:
        """A spend-limit refusal, marked when no wait can end it: a $0 limit lets no request
        pass, and a hard limit smaller than this request's hold alone never lets it pass as
        sent (its message then says what the hold is made of and what would fit)."""
        denied = decision.denied
        if denied is None or decision.denied_limit is None:  # the balance: its own answer
            return Admission(Verdict.DENY, route, dialect, request, decision)
        if denied.limit <= 0:
            return Admission(Verdict.DENY, route, dialect, request, decision, never=Never.ANY)
        if not denied.hard:
            return Admission(Verdict.DENY, route, dialect, request, decision)
        coster, table = self.coster, self.coster.table
        tokens_in, tokens_out = admission_tokens(request, table, self.output)
        hold = worst_case(request, coster, (tokens_in, tokens_out))
        fits = self._fits(request, decision, tokens_in, tokens_out)
        if hold <= denied.limit:
            return Admission(Verdict.DENY, route, dialect, request, decision, fits=fits)
        price = table.lookup(request.model)  # None: the unknown-model rule's price, no hint
        choices = request.choices
        output = describe_output(request, tokens_out, table)
        message = f"it reserves {usd(hold)} for {tokens_in:,} input and {output}."
        if price is not None:
            # The input is estimated from the body's size, and setting max_tokens adds its
            # field to the body (under 40 bytes): the advice leaves room for it.
            grown = tokens_in if request.max_tokens is not None else tokens_in + _CAP_FIELD

            def cost_of(out: int) -> int:
                usage = Usage(input_tokens=grown, output_tokens=out * choices)
                return int(price.cost(usage))

            fitting = largest_fitting(cost_of, denied.limit, tokens_out // choices)
            message += " " + advice(request, fitting)
        else:
            verb = "Set" if request.max_tokens is None else "Lower"
            message += f" {verb} max_tokens, or shorten the prompt."
        return Admission(
            Verdict.DENY, route, dialect, request, decision, message, never=Never.AS_SENT, fits=fits
        )

    def _fits(
        self, request: InferenceRequest, decision: Decision, tokens_in: int, tokens_out: int
    ) -> int | None:
        """The largest output cap per completion under which a request a hard limit refused
        would fit what every hard limit checked has left now, when fitting is on, the request
        declared a cap, and that cap is at least the minimum (design.md, "Fit instead of
        refuse"); None otherwise."""
        least = self.settings.fit_min_output_tokens
        price = self.coster.table.lookup(request.model)
        if least is None or request.max_tokens is None or price is None:
            return None
        denied = decision.denied
        if not self.settings.fit_by_default and (denied is None or not denied.fit):
            return None  # a hard limit that has not opted in refuses as sent
        left = min(s.limit - s.used for s in decision.limits if s.hard)
        choices = request.choices

        def cost_of(out: int) -> int:
            return int(price.cost(Usage(input_tokens=tokens_in, output_tokens=out * choices)))

        fitting = largest_fitting(cost_of, left, tokens_out // choices)
        return fitting if least <= fitting < tokens_out // choices else None

    def _continued(
        self, now: datetime, t0: datetime | None, inference_id: str | None
    ) -> tuple[datetime, str | None]:
        """The start time and id an inference counts under: a retry or fallback keeps its
        original's, unless the mark can't be trusted."""
        if t0 is None or inference_id is None or t0.tzinfo is None:
            return now, None
        t0 = as_utc(t0)
        # A t0 from the future or from beyond the cache's grace would address keys that must
        # not exist; such a mark is ignored rather than trusted.
        if t0 > now or now - t0 > timedelta(seconds=self.settings.key_grace / 2):
            return now, None
        # The id goes into a response header and a ledger column: NUL, CR/LF, spaces or
        # anything beyond 64 visible ASCII characters would break one or the other.
        if _INFERENCE_ID.fullmatch(inference_id) is None:
            log.warning(
                "spendguard ignored a retry mark with an unusable inference id %r "
                "(1 to 64 visible ASCII characters): counted as a new inference",
                inference_id[:80],
            )
            return now, None
        return t0, inference_id

    def observe(
        self,
        admission: Admission,
        status_code: int,
        content_type: str | None,
        content_encoding: str | None,
    ) -> BodyObserver | None:
        """An observer for the response body, or None when the response won't be charged."""
        if not admission.allowed or not charged(status_code):
            return None
        return observer_for(admission.dialect, content_type, content_encoding or "identity")

    def use_prices(self, table: PriceTable) -> None:
        """Price with ``table`` from now on, running or not (a gateway's model names, known
        only once its app started). Admissions, finishes, settlement and recovery share the
        coster, so all of them move at once; an inference admitted before is finished at
        the new prices."""
        self.coster.use(table)  # first: it refuses a table without the prices it needs
        self.prices = table

    async def finish(
        self,
        admission: Admission,
        status_code: int,
        observer: BodyObserver | None,
        *,
        routed: str | None = None,
        alongside: Callable[[Usage | None, str], Awaitable[object]] | None = None,
    ) -> InferenceRecord | None:
        """Charge an admitted inference once, however it ended (``status_code`` 0: no
        response started; postflight applies the status rule). Never raises: the response
        is already out. ``alongside``: what other checks of the round finish with, called
        with the usage charged (None: not charged) and the model, right before the store's
        postflight is sent, so that its calls leave in the same round trip.

        The model charged, the first that applies: ``routed``, the model the gateway says it
        routed to, when the table prices it; the model of a deployment path; the model the
        response names, when the table prices it (a provider's own name for what it ran);
        the model the request names."""
        decision, request = admission.decision, admission.request
        if not admission.allowed or decision is None or request is None:
            return None  # refused or not checked: nothing reached the provider through us
        if not charged(status_code):
            also = alongside(None, request.model) if alongside is not None else None
            await self._release(decision)
            if also is not None:
                await also
            return None
        usage = observer.result() if observer is not None else None
        if usage is None:
            # The provider reported nothing (no usage in the stream, a disconnect): estimate
            # from the prompt and the text that was served.
            output = observer.output_chars if observer is not None else 0
            usage = estimate_usage(request.estimated_input_tokens, output)
        model = request.model
        served = observer.model if observer is not None else None
        if routed and self.coster.is_priced(routed):
            model = routed  # the router knows which deployment ran; a response may not say
        else:
            if served and not request.model_pinned and self.coster.is_priced(served):
                model = served  # what was actually served (aliases, fallbacks)
            if routed:
                self._unpriced_route(routed, model)
        also = alongside(usage, model) if alongside is not None else None
        try:
            return await self.postflight(
                decision, model=model, route=admission.route, status_code=status_code, usage=usage
            )
        except Exception:  # a bug here must not turn a served response into a 500
            log.exception("spendguard postflight failed for record %s", decision.record_id)
            return None
        finally:
            if also is not None:
                await also

    def _unpriced_route(self, routed: str, instead: str) -> None:
        # Not charged as unknown: the request's model passed admission priced (under
        # unknown_model=reject the only price there is), and a router's name with a typo
        # should not make an inference free or default-priced.
        if routed in self._unpriced_routes or len(self._unpriced_routes) >= _MAX_WARNED:
            return
        self._unpriced_routes.add(routed)
        log.warning(
            "spendguard: the app routed an inference to %r, which has no price: charged as "
            "%r instead (give it a price, or set the name the price table knows)",
            routed,
            instead,
        )

    # -- preflight ------------------------------------------------------------------------
    async def preflight(
        self,
        identity: Identity,
        t0: datetime,
        *,
        inference_id: str | None = None,
        request: InferenceRequest | None = None,
        route: str = "",
        now: datetime | None = None,
        tentative: bool = False,
        record_id: str | None = None,
    ) -> Decision:
        """One store call when the cache is warm; on a miss, load from the ledger and retry.
        ``now``: the clock's time, when the caller just read it (rates count from it).
        ``tentative``: an allowed decision is not counted yet (see :meth:`admit`).

        With ``request`` (and a shared store whose heartbeat runs), an allowed inference
        leaves its admission entry in the same store call (see :mod:`.entries`)."""
        record_id = record_id or new_record_id()
        inference_id = inference_id or record_id
        plan = self.codec.plan(identity, t0)
        fail_open = self._fail_open
        entry: EntryWrite | None = None
        hold = tokens = 0
        model = ""
        if request is not None:
            model = request.model
            admitting = admission_tokens(request, self.coster.table, self.output)
            # What a hard limit holds for this request until it ends (soft limits ignore it),
            # and a TPM's reserve.
            hold = worst_case(request, self.coster, admitting)
            tokens = admitting[0] + admitting[1]
            if self._entries_on:
                entry_key = self.codec.entries_key(identity.team)
                value = open_entry(
                    self.owner, identity, to_micros(t0), inference_id, request, route, admitting
                )
                entry = EntryWrite(entry_key, record_id, value)
        # What every decision below is made of (a tuple, not a closure: nothing is allocated
        # per call beyond it).
        made = (identity, t0, record_id, inference_id, plan, entry, tentative)
        conclude = self._conclude
        if self._refused:  # never fails open: this process's counts are not the limit's
            return conclude(made, Verdict.UNAVAILABLE, unavailable=Unavailable.STORE)

        try:
            if entry is not None and identity.team not in self._entry_teams:
                # Once per team and process (concurrent first requests share one call):
                # recovery finds entries through this list.
                await self._registering.do(identity.team, partial(self._register, identity.team))
            for _ in range(_MAX_FILL_ROUNDS):
                started = perf_counter()
                try:
                    pf = await self.store.preflight(
                        plan,
                        entry,
                        record_id=record_id,
                        hold=hold,
                        model=model,
                        tokens=tokens,
                        now_ms=to_millis(self.clock() if now is None else now),
                        slot_ttl_ms=int(self.settings.rate_slot_ttl * 1000),
                    )
                finally:
                    _PREFLIGHT_SECONDS.observe(perf_counter() - started)
                if len(self.outage):
                    self.outage.clear()  # the store answers again
                outcome = pf.outcome
                if outcome is Outcome.ALLOW:
                    if fail_open:
                        self.outage.remember(pf.limits)  # enforceable in a later outage
                    return conclude(made, Verdict.ALLOW, pf)
                if outcome is Outcome.DENY:
                    return conclude(made, Verdict.DENY, pf)
                if outcome is Outcome.MODEL:
                    return conclude(made, Verdict.MODEL_NOT_ALLOWED, pf)
                if outcome is Outcome.RATE:
                    return conclude(made, Verdict.RATE_LIMITED, pf)
                await self.filler.fill(plan, pf)
        except StoreFull as exc:
            log.error("spendguard store full, refusing: %s", exc)
            metrics.STORE_UNAVAILABLE.labels("deny").inc()
            return conclude(made, Verdict.UNAVAILABLE, unavailable=Unavailable.STORE_FULL)
        except StoreUnavailable as exc:
            # Fail closed (503), or fail open into the bounded local tracker, which still
            # refuses what it knows to be over a limit.
            if fail_open and (spent := self.outage.exhausted(plan)) is not None:
                log.warning("spendguard store unavailable, limit reached as last known: %s", exc)
                return conclude(made, Verdict.DENY, Preflight(Outcome.DENY, (spent,)))
            if fail_open and self.outage.admit(identity):
                log.warning("spendguard store unavailable, allowing (fail open): %s", exc)
                metrics.STORE_UNAVAILABLE.labels("allow").inc()
                # The store did not answer: no entry was written.
                made = (identity, t0, record_id, inference_id, plan, None, tentative)
                return conclude(made, Verdict.ALLOW, fail_open=True)
            log.warning("spendguard store unavailable, refusing: %s", exc)
            metrics.STORE_UNAVAILABLE.labels("deny").inc()
            return conclude(made, Verdict.UNAVAILABLE, unavailable=Unavailable.STORE)
        except (LedgerUnavailable, TimeoutError) as exc:
            log.warning("spendguard ledger read failed on a cache miss: %r", exc)
            return conclude(made, Verdict.UNAVAILABLE, unavailable=Unavailable.LEDGER)
        except ValueError as exc:
            # The store refused values read from the ledger (a script's own check): a bug or a
            # hand-edited row. One team's 503 with a loud log, never a 500.
            log.error(
                "spendguard store refused the cached values of team %s: %s", identity.team, exc
            )
            return conclude(made, Verdict.UNAVAILABLE, unavailable=Unavailable.STORE)
        log.warning(
            "spendguard cache still missing %s after %d fills for team %s",
            "the policy" if pf.missing_policy else [c.field for c in pf.missing_usage],
            _MAX_FILL_ROUNDS,
            identity.team,
        )
        return conclude(made, Verdict.UNAVAILABLE, unavailable=Unavailable.VANISHED)

    def _conclude(
        self,
        made: tuple[Identity, datetime, str, str, KeyPlan, EntryWrite | None, bool],
        verdict: Verdict,
        pf: Preflight | None = None,
        *,
        fail_open: bool = False,
        unavailable: Unavailable | None = None,
    ) -> Decision:
        """The decision of one preflight (``made``: what ``preflight`` made it of; its last
        part: an allowed decision is not counted here, a tentative one's)."""
        identity, t0, record_id, inference_id, plan, entry, uncounted = made
        if entry is not None and verdict is Verdict.UNAVAILABLE:
            # The store may have run the script before the failure: remove the entry with
            # the next records written, so it never stands for an inference not served.
            self._note_unclosed({record_id: entry.key})
        if pf is None:  # no store answer: an outage, or failing open
            limits: tuple[LimitState, ...] = ()
            rates: tuple[RateState, ...] = ()
            rate_denied: RateDenial | None = None
            target = None
        else:
            limits, rates, rate_denied = pf.limits, pf.rates, pf.rate_denied
            denied = pf.denied
            target = denied.check.target if denied is not None else None
        if rate_denied is not None:
            retry_after: int | None = rate_denied.retry_after()
        elif isinstance(target, Limit):
            retry_after = target.window.seconds_to_reset(self.clock())
        else:  # a balance never resets by itself; an outage is retried shortly
            retry_after = _OUTAGE_RETRY_AFTER if verdict is Verdict.UNAVAILABLE else None
        allowed = verdict is Verdict.ALLOW
        if not (uncounted and allowed):  # a tentative one is counted by confirm()
            decided(verdict, bool(limits), target, fail_open, unavailable)
        return Decision(
            verdict,
            identity,
            t0,
            record_id,
            inference_id,
            limits,
            retry_after,
            fail_open,
            unavailable,
            entry.key if entry is not None and allowed else None,
            rates,
            rate_denied,
            tuple(plan.rate_keys[r.scope is SubjectKind.TEAM] for r in rates if r.tracked)
            if rates and allowed
            else (),
        )

    async def withdraw(self, admission: Admission) -> None:
        """Take back an admission another check refused in the same round (a budget, the
        provider pool): its holds, its admission entry and its in-flight rates go, and its
        count in the rates' minute too, as if it had never been admitted. Never raises."""
        decision = admission.decision
        if not admission.allowed or decision is None:
            return
        rated = decision.rates
        if not rated:
            await self._release(decision)
            return
        plan = self.codec.plan(decision.identity, decision.t0)
        keys = tuple(plan.rate_keys[r.scope is SubjectKind.TEAM] for r in rated)
        await self._release(decision, keys, rated[0].now_ms // WINDOW_MS)

    def confirm(self, admission: Admission) -> None:
        """Count a tentative admission (``admit(tentative=True)``) that every other check of
        its round admitted too."""
        decision = admission.decision
        if admission.allowed and decision is not None:
            decided(Verdict.ALLOW, bool(decision.limits), None, decision.fail_open, None)

    async def _release(
        self,
        decision: Decision,
        rate_keys: tuple[str, ...] | None = None,
        withdrawn: int | None = None,
    ) -> None:
        """An admitted inference that is not charged (an upstream error, no response): its
        holds on hard limits and its admission entry go; there will be no record."""
        keys = [state.check.usage_key for state in decision.limits if state.hard]
        if rate_keys is None:
            rate_keys = decision.rate_keys
        if not keys and decision.entry_key is None and not rate_keys:
            return
        started = perf_counter()
        try:
            await self.store.postflight(
                decision.record_id,
                None,
                keys,
                entry_key=decision.entry_key,
                rate_keys=rate_keys,
                withdrawn=withdrawn,
            )
        except Exception as exc:
            # A hold left behind blocks budget until its key expires, so the release is
            # retried with the next records written; the entry stays until then (were this
            # process to die first, recovery charges its admission estimate and settlement
            # releases the hold).
            log.warning("spendguard could not release an admission: %r", exc)
            if len(self._unreleased) < _MAX_UNCLOSED:
                self._unreleased.append(decision)
        finally:
            _RELEASE_SECONDS.observe(perf_counter() - started)

    # -- postflight -----------------------------------------------------------------------
    async def postflight(
        self,
        decision: Decision,
        *,
        model: str,
        route: str,
        status_code: int,
        usage: Usage,
    ) -> InferenceRecord | None:
        """Charge a finished inference once: estimate into the cache, record to the ledger.

        Only 2xx responses are charged. Never raises on a store failure: the outcome is then
        ``unknown`` for settlement to correct; a postflight is never re-run.
        """
        if not charged(status_code):
            return None
        # The one price lookup: the estimate and the record's price come from it, so
        # settlement charges what was estimated whatever table the settling process has.
        price = self.coster.price(model)
        estimate = 0 if price is None else int(price.cost(usage))
        count_charge(estimate, usage)
        if decision.fail_open:
            plan = self.codec.plan(decision.identity, decision.t0)
            self.outage.charge(decision.identity, estimate, [c.usage_key for c in plan.checks])
        status = PostflightStatus.SKIPPED
        keys = [limit.check.usage_key for limit in decision.limits]
        entry_key, closed, rate_keys = decision.entry_key, "", decision.rate_keys
        # The record as it will be if postflight applies (the common case); the entry takes it
        # whole (as applied when it has keys: a key that vanished meanwhile only makes
        # settlement look for a marker that is not there).
        expected = PostflightStatus.APPLIED if keys else PostflightStatus.SKIPPED
        record = InferenceRecord(
            decision.record_id,
            decision.inference_id,
            decision.identity,
            model,
            route,
            decision.t0,
            status_code,
            usage,
            estimate,
            expected,
            _price_text(price),
            decision.end_user,
            decision.tags,
            decision.customer,
        )
        if entry_key is not None:
            closed = closed_entry(self.owner, record, to_micros(decision.t0))
        marks = None
        if keys and (
            self._thresholds or any(state.alert_at is not None for state in decision.limits)
        ):  # the default thresholds, or a limit's own
            alerts_key = self.codec.alerts_key(decision.identity.team)
            marks = marks_for(alerts_key, decision.limits, self._thresholds)
        if keys or entry_key is not None or rate_keys:
            started = perf_counter()
            try:
                # No deadline here: every store bounds its own calls (the Redis store by its
                # timeout; the embedded store never waits).
                applied = await self.store.postflight(
                    decision.record_id,
                    estimate,
                    keys,
                    entry_key=entry_key,
                    closed=closed,
                    rate_keys=rate_keys,
                    # What a TPM's reserve is trued up to (only an in-flight rate has one).
                    tokens=usage.total_tokens if rate_keys else None,
                    alerts=marks,
                )
                if marks is not None and marks.fired:
                    self.alerts.note(decision.identity.team)
                if self._projected:
                    self.alerts.charged(decision.identity.team_id)
                status = PostflightStatus.APPLIED if applied else PostflightStatus.SKIPPED
                if applied and self._fail_open:
                    self.outage.add(keys, estimate)  # what a later outage knows includes it
            except Exception as exc:  # the response is already out; never fail the request
                log.warning("spendguard postflight outcome unknown: %r", exc)
                status = PostflightStatus.UNKNOWN if keys else PostflightStatus.SKIPPED
                if marks is not None:
                    # It may have run and fired with its reply lost: look on the next pass.
                    self.alerts.note(decision.identity.team)
            finally:
                _POSTFLIGHT_SECONDS.observe(perf_counter() - started)
        if status is not expected:
            record = dataclasses.replace(record, postflight=status)
        self.recorder.submit(record)
        if not self.running:
            # No lifespan ran (e.g. an ASGI test client without it): write through, slowly
            # but durably, instead of leaving the record in a queue nobody drains.
            try:
                await self._ensure_connected()
                with anyio.fail_after(self.settings.db_timeout):
                    await self.recorder.flush()
            except (LedgerUnavailable, TimeoutError) as exc:
                log.error("spendguard could not write record %s: %s", record.id, exc)
        return record
