"""The engine: preflight, postflight and the background tasks, with no ASGI in sight.

:class:`SpendGuard` is what the middleware drives; a non-ASGI gateway can call it directly::

    async with SpendGuard(settings) as guard:
        decision = await guard.preflight(Identity("acme", "alpha"), t0)
        ...
        await guard.postflight(decision, model=..., route=..., status_code=200, usage=...)
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from types import TracebackType

import anyio
from anyio.abc import TaskGroup, TaskStatus

from . import metrics
from .costing import Coster
from .errors import ConfigurationError, LedgerUnavailable, StoreFull, StoreUnavailable
from .identity import Identity
from .keys import KeyPlan, Scope, parse_field, plan
from .ledger import Ledger
from .outage import OutageTracker
from .periods import seconds_to_reset, utcnow
from .pricing import PriceTable
from .record import InferenceRecord, PostflightStatus
from .recorder import Recorder
from .settings import FailMode, Settings, load_settings
from .singleflight import SingleFlight
from .store.base import LimitState, Outcome, Preflight, Store, UsageFill
from .store.memory import MemoryStore
from .store.redis import RedisStore
from .usage import Usage
from .worker import SettlementWorker

log = logging.getLogger("spendguard")

_MAX_FILL_ROUNDS = 3  # a miss, a fill and a re-check; more means keys vanish as we fill them
_POSTFLIGHT_TIMEOUT = 2.0


def make_store(settings: Settings, clock: Callable[[], datetime] = utcnow) -> Store:
    """The store the settings ask for: Redis when a URL is set, else the embedded one."""
    if settings.redis_url is not None:
        return RedisStore.from_url(
            settings.redis_url.get_secret_value(), timeout=settings.redis_timeout
        )
    return MemoryStore(max_keys=settings.memory_max_keys, clock=clock)


class Verdict(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    UNAVAILABLE = "unavailable"  # store or ledger could not answer: 503


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    identity: Identity
    t0: datetime
    record_id: str
    inference_id: str
    plan: KeyPlan
    limits: tuple[LimitState, ...] = ()  # policy-bearing limits: what postflight charges
    retry_after: int | None = None
    reason: str = ""

    @property
    def denied(self) -> LimitState | None:
        return self.limits[-1] if self.verdict is Verdict.DENY and self.limits else None


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
        self.store: Store = store if store is not None else make_store(s, clock)
        self.outage = OutageTracker(s.fail_open_max_keys)
        self.ledger = ledger if ledger is not None else Ledger(s.database_url.get_secret_value())
        self.prices = prices if prices is not None else PriceTable.load(s.prices)
        self.coster = Coster(self.prices, s.unknown_model)
        self.recorder = Recorder(self.ledger, capacity=s.record_buffer)
        self.worker = SettlementWorker(
            self.ledger,
            self.store,
            self.coster,
            key_prefix=s.key_prefix,
            batch_size=s.settle_batch,
            settle=s.run_worker,
            clock=clock,
        )
        self._grace = timedelta(seconds=s.key_grace)
        self._loads: SingleFlight[object] = SingleFlight()
        self._stack: AsyncExitStack | None = None
        self._cancel: anyio.CancelScope | None = None
        self._stopped = anyio.Event()
        self._connect_lock = anyio.Lock()

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Background tasks are up (the ASGI lifespan ran, or ``start()`` was called)."""
        return self._cancel is not None

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
        await self._ensure_connected()
        if isinstance(self.store, RedisStore):
            await self.store.check_eviction_policy()
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
                    if run_worker:
                        await tg.start(self.worker.run, self.settings.settle_interval)
                    task_status.started(scope)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop taking work, flush the records (shielded, bounded) and disconnect."""
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
            with anyio.move_on_after(10):
                try:
                    await self.recorder.flush()
                except LedgerUnavailable as exc:
                    log.error(
                        "spendguard lost %d unwritten records at shutdown: %s",
                        self.recorder.pending,
                        exc,
                    )
            await self.ledger.disconnect()

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

    # -- preflight ------------------------------------------------------------------------
    async def preflight(
        self, identity: Identity, t0: datetime, *, inference_id: str | None = None
    ) -> Decision:
        """One store call when the cache is warm; on a miss, load from the ledger and retry."""
        record_id = uuid.uuid4().hex
        keys = plan(self.settings.key_prefix, identity, t0, self._grace)

        def decide(verdict: Verdict, pf: Preflight | None = None, reason: str = "") -> Decision:
            denied = pf.denied if pf is not None else None
            return Decision(
                verdict=verdict,
                identity=identity,
                t0=t0,
                record_id=record_id,
                inference_id=inference_id or record_id,
                plan=keys,
                limits=pf.limits if pf is not None else (),
                retry_after=(
                    seconds_to_reset(denied.candidate.period, self.clock())
                    if denied is not None and denied.candidate.period is not None
                    else (1 if verdict is Verdict.UNAVAILABLE else None)
                ),
                reason=reason,
            )

        try:
            for _ in range(_MAX_FILL_ROUNDS):
                pf = await self.store.preflight(keys)
                if len(self.outage):
                    self.outage.clear()  # the store answers again
                if pf.outcome is Outcome.ALLOW:
                    return decide(Verdict.ALLOW, pf)
                if pf.outcome is Outcome.DENY:
                    return decide(Verdict.DENY, pf)
                await self._recover(keys, pf)
        except StoreFull as exc:
            log.error("spendguard store full, refusing: %s", exc)
            metrics.STORE_UNAVAILABLE.labels("deny").inc()
            return decide(Verdict.UNAVAILABLE, reason="store full")
        except StoreUnavailable as exc:
            return self._store_down(decide, identity, exc)
        except (LedgerUnavailable, TimeoutError) as exc:
            log.warning("spendguard ledger read failed on a cache miss: %r", exc)
            return decide(Verdict.UNAVAILABLE, reason="ledger")
        log.warning(
            "spendguard cache still missing %s after %d fills for team %s",
            "the policy" if pf.missing_policy else [c.field for c in pf.missing_usage],
            _MAX_FILL_ROUNDS,
            identity.team,
        )
        return decide(Verdict.UNAVAILABLE, reason="cache keys vanished while filling")

    def _store_down(
        self, decide: Callable[..., Decision], identity: Identity, exc: StoreUnavailable
    ) -> Decision:
        """R5.4: fail closed (503), or fail open into the bounded local tracker."""
        if self.settings.fail_mode is FailMode.OPEN and self.outage.admit(identity):
            log.warning("spendguard store unavailable, allowing (fail open): %s", exc)
            metrics.STORE_UNAVAILABLE.labels("allow").inc()
            return decide(Verdict.ALLOW, reason="fail open")
        log.warning("spendguard store unavailable, refusing: %s", exc)
        metrics.STORE_UNAVAILABLE.labels("deny").inc()
        return decide(Verdict.UNAVAILABLE, reason="store")

    async def _recover(self, keys: KeyPlan, pf: Preflight) -> None:
        """R5.3: read policies and aggregates (coalesced per key), fill only empty keys."""
        await self._ensure_connected()
        policies: dict[str, int] | None = None
        if pf.missing_policy:
            loaded = await self._load(("policy", keys.team), self.ledger.load_policies, keys.team)
            assert isinstance(loaded, dict)
            policies = loaded
            wanted = [c for c in keys.candidates if c.field in policies]
        else:
            wanted = list(pf.missing_usage)
        fills: list[UsageFill] = []
        if any(c.scope is Scope.BALANCE for c in wanted):
            loaded = await self._load(("balance", keys.team), self.ledger.load_balance, keys.team)
            assert isinstance(loaded, tuple)
            topped_up, charged = loaded
            cand = next(c for c in wanted if c.scope is Scope.BALANCE)
            fills.append(UsageFill(cand.usage_key, charged, cand.expires_at, limit=topped_up))
        wanted = [c for c in wanted if c.period is not None]
        if wanted:
            spec = [(c, (_api_key_of(c.field), c.period, c.period_id)) for c in wanted]
            sig = ("agg", keys.team, tuple(s for _, s in spec))
            loaded = await self._load(
                sig, self.ledger.load_aggregates, keys.team, [s for _, s in spec]
            )
            assert isinstance(loaded, dict)
            fills += [UsageFill(c.usage_key, int(loaded[s]), c.expires_at) for c, s in spec]
        await self.store.fill(keys, policies, fills, policy_ttl=self.settings.policy_ttl)

    async def _load(self, key: object, fn: Callable[..., object], *args: object) -> object:
        async def call() -> object:
            with anyio.fail_after(self.settings.db_timeout):
                return await fn(*args)  # type: ignore[misc]

        return await self._loads.do(key, call)

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

        Only 2xx responses are charged (R6.2). Never raises: a store failure leaves the
        outcome ``unknown`` for settlement to correct (R6.4: never re-run).
        """
        if not 200 <= status_code < 300:
            return None
        estimate = self.coster.cost(model, usage)
        if decision.reason == "fail open":
            self.outage.charge(decision.identity, estimate)
        status = PostflightStatus.SKIPPED
        keys = [limit.candidate.usage_key for limit in decision.limits]
        if keys:
            try:
                with anyio.fail_after(_POSTFLIGHT_TIMEOUT):
                    applied = await self.store.postflight(decision.record_id, estimate, keys)
                status = PostflightStatus.APPLIED if applied else PostflightStatus.SKIPPED
            except Exception as exc:  # the response is already out; never fail the request
                log.warning("spendguard postflight outcome unknown: %r", exc)
                status = PostflightStatus.UNKNOWN
        record = InferenceRecord(
            id=decision.record_id,
            inference_id=decision.inference_id,
            identity=decision.identity,
            model=model,
            route=route,
            t0=decision.t0,
            status_code=status_code,
            usage=usage,
            estimate_micros=estimate,
            postflight=status,
        )
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


def _api_key_of(field: str) -> str | None:
    parsed = parse_field(field)
    return None if parsed is None else parsed[1]
