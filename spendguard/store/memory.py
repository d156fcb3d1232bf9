"""The embedded store: the Redis store's semantics in one process, for zero-service setups.

Every method runs without an ``await`` between its reads and writes, so on one event loop each
call is as atomic as a Lua script. The store is bounded: when it is full of live keys, ``fill``
raises :class:`StoreFull` and the request is refused, never allowed untracked.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from ..clock import to_millis, utcnow
from ..errors import StoreFull
from ..limits import Balance, KeyPlan
from ..limits.capacity import Acquired, Attempt, ProviderKey, Refusal, StoredKey
from ..limits.codec import ALERT_PREFIX, FIT_PREFIX, HARD_PREFIX, LOADED_FIELD
from ..limits.model import SubjectKind, Unit
from ..limits.models import ALLOW_PREFIX, allows
from ..limits.rates import (
    RATE_PREFIX,
    RATE_WIRE,
    WINDOW_MS,
    Rates,
    RateState,
    exceeds,
    minute_of,
)
from ..limits.windows import DAY_MS, SLICES, Rolling
from .base import (
    FITS,
    HARD,
    AlertMarks,
    CachedParts,
    EntryWrite,
    Found,
    Outcome,
    Preflight,
    RefreshEntry,
    UsageFill,
    decide,
    with_rates,
)
from .rolling import (
    Bucket,
    BucketCheck,
    BucketUsage,
    Commit,
    Hold,
    Reserved,
    SeedSlice,
    WindowUsage,
    limit_marks,
    retry_ms,
)


@dataclass(slots=True)
class _Usage:
    settled: int
    expires_at: datetime
    limit: int | None = None  # balance keys: topped up
    pending: int = 0
    markers: dict[str, int] = field(default_factory=dict)
    tombstones: set[str] = field(default_factory=set)
    holds: dict[str, int] = field(default_factory=dict)  # record id -> hold (hard limits)
    alerted: set[str] = field(default_factory=set)  # "<percent>:<limit>" fired in this window


@dataclass(slots=True)
class _Policy:
    limits: dict[str, int]
    expires_at: datetime
    models: dict[str, str] = field(default_factory=dict)  # allow field -> encoded list
    rates: dict[str, Rates] = field(default_factory=dict)  # rate field -> the subject's rates
    alerts: dict[str, str] = field(default_factory=dict)  # check field -> its own thresholds
    # A check's field -> (its limit, mode as in base.Found): the hard limit where the policy
    # has one, fitting or not (read once here, not per request and check).
    held_to: dict[str, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = self.limits
        held: dict[str, tuple[int, int]] = {}
        for name, amount in limits.items():
            if name.startswith(FIT_PREFIX):
                held[name[len(FIT_PREFIX) :]] = (amount, FITS)
            elif name.startswith(HARD_PREFIX):
                if FIT_PREFIX + name[len(HARD_PREFIX) :] not in limits:
                    held[name[len(HARD_PREFIX) :]] = (amount, HARD)
            elif HARD_PREFIX + name not in limits and FIT_PREFIX + name not in limits:
                held[name] = (amount, 0)
        self.held_to = held


@dataclass(slots=True)
class _Rate:
    """A subject's rate hash (see :mod:`spendguard.limits.rates`), as the script keeps it."""

    minute: int
    requests: int = 0
    tokens: int = 0
    prev_requests: int = 0
    prev_tokens: int = 0
    # record id -> (deadline ms, minute, reserved tokens or None)
    slots: dict[str, tuple[int, int, int | None]] = field(default_factory=dict)
    earliest: int | None = None  # no later than the earliest deadline of slots
    expires_ms: int = 0

    def roll(self, minute: int) -> None:
        if self.minute == minute - 1:
            self.prev_requests, self.prev_tokens = self.requests, self.tokens
            self.requests = self.tokens = 0
        elif self.minute < minute - 1:
            self.prev_requests = self.prev_tokens = self.requests = self.tokens = 0
        self.minute = max(self.minute, minute)


def _window_key(window: Rolling) -> tuple[str, str]:
    # A window whose period changes (a reload) starts a new series: old slices meant other times.
    return (window.id, window.label)


@dataclass(slots=True)
class _Slices:
    tokens: dict[int, int] = field(default_factory=dict)
    cost: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    alerted: dict[str, str] = field(default_factory=dict)  # threshold -> epoch it last fired in

    def drop_before(self, lo: int) -> None:
        for series in (self.tokens, self.cost, self.requests):
            for idx in [i for i in series if i < lo]:
                del series[idx]

    def current(self, window: Rolling, now_ms: int) -> tuple[int, int, int]:
        self.drop_before(window.first_slice(now_ms))
        return sum(self.tokens.values()), sum(self.cost.values()), sum(self.requests.values())


@dataclass(slots=True)
class _Bucket:
    """A rolling-window bucket: its live holds and each window's slices."""

    holds: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # id: exp, tok, cost
    windows: dict[tuple[str, str], _Slices] = field(default_factory=dict)

    def prune(self, now_ms: int) -> tuple[int, int]:
        expired = [h for h, (exp, _, _) in self.holds.items() if exp <= now_ms]
        for hold_id in expired:
            del self.holds[hold_id]
        return (
            sum(t for _, t, _ in self.holds.values()),
            sum(c for _, _, c in self.holds.values()),
        )

    def slices(self, window: Rolling) -> _Slices:
        key = _window_key(window)
        found = self.windows.get(key)
        if found is None:
            found = self.windows[key] = _Slices()
        return found

    @property
    def empty(self) -> bool:
        return not self.holds and not any(
            s.tokens or s.cost or s.requests for s in self.windows.values()
        )


@dataclass(slots=True)
class _ProviderKey:
    """A provider key's capacity, its one-minute counters and its cooldown end."""

    provider: str
    tpm: int | None
    rpm: int | None
    window: int = -1
    requests: int = 0
    tokens: int = 0
    cooling_until: int = 0

    def open(self, window: int) -> None:
        """Make ``window`` the counted one (a window that is over counts as 0)."""
        if self.window != window:
            self.window, self.requests, self.tokens = window, 0, 0

    def attempt(self, tokens: int, now_ms: int) -> Attempt:
        if self.cooling_until > now_ms:
            return Attempt(Refusal.COOLING, free_at_ms=self.cooling_until)
        if self.tpm is not None and tokens > self.tpm:
            return Attempt(Refusal.TOO_LARGE)
        window = now_ms // WINDOW_MS
        self.open(window)
        if (self.rpm is not None and self.requests + 1 > self.rpm) or (
            self.tpm is not None and self.tokens + tokens > self.tpm
        ):
            return Attempt(Refusal.FULL, free_at_ms=(window + 1) * WINDOW_MS)
        self.requests += 1
        self.tokens += tokens
        return Attempt(None, window=window)


class MemoryStore:
    shared = False  # lives in one process: other processes (a CLI) can't reach it

    def __init__(self, *, max_keys: int = 100_000, clock: Callable[[], datetime] = utcnow) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be positive")
        self._max_keys = max_keys
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self._policies: dict[str, _Policy] = {}
        # Admission entries, as the Redis store keeps them (one process: a crash loses them
        # with everything else, so the engine writes none here; kept for the one contract).
        self._entries: dict[str, dict[str, str]] = {}
        self._alerts: dict[str, dict[str, str]] = {}
        self._rates: dict[str, _Rate] = {}
        self._buckets: dict[Bucket, _Bucket] = {}
        # Provider keys are few (the operator registers them): outside the bound.
        self._provider_keys: dict[str, _ProviderKey] = {}

    # -- helpers --------------------------------------------------------------------------
    def _live_usage(self, key: str, now: datetime) -> _Usage | None:
        entry = self._usage.get(key)
        if entry is not None and entry.expires_at <= now:
            del self._usage[key]
            return None
        return entry

    def _live_policy(self, key: str, now: datetime) -> _Policy | None:
        entry = self._policies.get(key)
        if entry is not None and entry.expires_at <= now:
            del self._policies[key]
            return None
        return entry

    def _make_room(self, needed: int, now: datetime) -> None:
        if len(self) + needed <= self._max_keys:
            return
        for key in [k for k, v in self._usage.items() if v.expires_at <= now]:
            del self._usage[key]
        for key in [k for k, p in self._policies.items() if p.expires_at <= now]:
            del self._policies[key]
        now_ms = to_millis(now)
        for key in [k for k, r in self._rates.items() if r.expires_ms <= now_ms]:
            del self._rates[key]
        if len(self) + needed > self._max_keys:
            raise StoreFull(f"embedded store is full ({self._max_keys} keys)")

    # -- Store ----------------------------------------------------------------------------
    async def start(self) -> None:
        pass

    async def preflight(
        self,
        plan: KeyPlan,
        entry: EntryWrite | None = None,
        *,
        record_id: str = "",
        hold: int = 0,
        model: str = "",
        tokens: int = 0,
        now_ms: int | None = None,
        slot_ttl_ms: int = 600_000,
    ) -> Preflight:
        _check_amount(hold)
        _check_amount(tokens)
        now = self._clock()  # once per call: every check below is at the same instant
        policy = self._live_policy(plan.policy_key, now)
        if policy is None:
            return Preflight(Outcome.MISS, missing_policy=True)
        models = policy.models
        if (
            model
            and models
            and any(not allows(models[f], model) for f in plan.allow_fields if f in models)
        ):
            return Preflight(Outcome.MODEL)
        pf = self._preflight(plan, policy, hold, now)
        rid = entry.record_id if entry is not None else record_id
        if policy.rates and pf.outcome is Outcome.ALLOW:
            now_ms = to_millis(now) if now_ms is None else now_ms
            pf = self._rate(plan, policy, pf, rid, tokens, now_ms, slot_ttl_ms)
        if pf.outcome is Outcome.ALLOW:
            if hold:
                for state in pf.limits:
                    usage = self._live_usage(state.check.usage_key, now)
                    if state.hard and usage is not None and rid not in usage.holds:
                        usage.holds[rid] = hold
                        usage.pending += hold
            if entry is not None:
                self._entries.setdefault(entry.key, {})[entry.record_id] = entry.value
        return pf

    def _rate(
        self,
        plan: KeyPlan,
        policy: _Policy,
        pf: Preflight,
        rid: str,
        tokens: int,
        now_ms: int,
        slot_ttl_ms: int,
    ) -> Preflight:
        """The rates of the plan's key and team (preflight.lua's rule, on the same integers)."""
        minute, weight = minute_of(now_ms)
        rated: list[tuple[SubjectKind, Rates, _Rate, str]] = []
        denial: str | None = None
        for scope, fld, key in zip(
            (SubjectKind.API_KEY, SubjectKind.TEAM), plan.rate_fields, plan.rate_keys, strict=True
        ):
            rates = policy.rates.get(fld) if fld else None
            if rates is None:
                continue
            rate = self._rates.get(key)
            if rate is None or rate.expires_ms <= now_ms:
                self._rates.pop(key, None)
                self._make_room(1, self._clock())
                rate = _Rate(minute)
            rate.roll(minute)
            if rate.earliest is not None and now_ms >= rate.earliest:
                # Some entry may have outlived its deadline (its gateway died): drop them.
                rate.slots = {k: v for k, v in rate.slots.items() if v[0] > now_ms}
                rate.earliest = min((v[0] for v in rate.slots.values()), default=None)
            if denial is None:
                if rates.rpm and exceeds(rate.prev_requests, rate.requests, 1, rates.rpm, weight):
                    denial = f"{RATE_WIRE[scope]}:rpm"
                elif rates.tpm and exceeds(
                    rate.prev_tokens, rate.tokens, tokens, rates.tpm, weight
                ):
                    denial = f"{RATE_WIRE[scope]}:tpm"
                elif rates.max_parallel and len(rate.slots) + 1 > rates.max_parallel:
                    denial = f"{RATE_WIRE[scope]}:par"
            rated.append((scope, rates, rate, key))
        if denial is None:
            deadline = now_ms + slot_ttl_ms
            for _, rates, rate, key in rated:
                rate.requests += 1
                if rates.tpm:
                    rate.tokens += tokens
                if (rates.tpm or rates.max_parallel) and rid not in rate.slots:
                    rate.slots[rid] = (deadline, minute, tokens if rates.tpm else None)
                    if rate.earliest is None:
                        rate.earliest = deadline
                rate.expires_ms = now_ms + max(2 * WINDOW_MS, slot_ttl_ms) + WINDOW_MS
                self._rates[key] = rate
        states = {
            scope: RateState(
                scope,
                rates,
                rate.prev_requests,
                rate.requests,
                rate.prev_tokens,
                rate.tokens,
                len(rate.slots),
                now_ms,
            ).encode()
            for scope, rates, rate, _ in rated
        }
        return with_rates(
            pf,
            denial,
            [states.get(SubjectKind.API_KEY), states.get(SubjectKind.TEAM)],
            now_ms,
            tokens,
        )

    def _preflight(self, plan: KeyPlan, policy: _Policy, hold: int, now: datetime) -> Preflight:
        checks: list[Found] = []
        held_to = policy.held_to
        for check in plan.checks:
            found = held_to.get(check.field)
            if found is None:  # no policy: its usage key is not even looked at
                continue
            limit, hard = found
            usage = self._live_usage(check.usage_key, now)
            used = None
            if usage is not None:
                used = usage.settled + usage.pending
                if isinstance(check.target, Balance):
                    limit = usage.limit or 0
            checks.append((check, limit, used, hard, policy.alerts.get(check.field)))
        return decide(checks, hold)

    async def fill(
        self,
        plan: KeyPlan,
        policies: Mapping[str, int | str] | None,
        usage: Sequence[UsageFill],
        *,
        policy_ttl: float,
    ) -> None:
        now = self._clock()
        given = policies or {}
        amounts = {
            k: v
            for k, v in given.items()
            if not k.startswith((ALLOW_PREFIX, RATE_PREFIX, ALERT_PREFIX))
        }
        alerts = {
            k[len(ALERT_PREFIX) :]: str(v) for k, v in given.items() if k.startswith(ALERT_PREFIX)
        }
        if not all(re.fullmatch(r"[\d,]{0,256}", v) for v in alerts.values()):
            raise ValueError("alert thresholds must be comma-separated whole numbers")
        models = {k: v for k, v in given.items() if k.startswith(ALLOW_PREFIX)}
        rates = {k: Rates.decode(str(v)) for k, v in given.items() if k.startswith(RATE_PREFIX)}
        for value in [*amounts.values(), *(u.settled for u in usage)]:
            _check_amount(value)  # type: ignore[arg-type]  # a str fails the check
        if not all(isinstance(v, str) and v for v in models.values()):
            raise ValueError("a model list must be a non-empty string")
        for u in usage:
            if u.limit is not None:
                _check_amount(u.limit)
        new_policy = policies is not None and self._live_policy(plan.policy_key, now) is None
        new_usage = [
            u for u in usage if u.expires_at > now and self._live_usage(u.usage_key, now) is None
        ]
        self._make_room(len(new_usage) + int(new_policy), now)
        if new_policy and policies is not None:
            limits = {k: v for k, v in amounts.items() if k != LOADED_FIELD}
            self._policies[plan.policy_key] = _Policy(
                limits,  # type: ignore[arg-type]  # checked above: integers only
                now + timedelta(seconds=policy_ttl),
                {k: str(v) for k, v in models.items()},
                rates,
                alerts,
            )
        for u in new_usage:
            self._usage[u.usage_key] = _Usage(u.settled, u.expires_at, limit=u.limit)

    async def postflight(
        self,
        record_id: str,
        amount: int | None,
        usage_keys: Sequence[str],
        *,
        entry_key: str | None = None,
        closed: str = "",
        rate_keys: Sequence[str] = (),
        tokens: int | None = None,
        withdrawn: int | None = None,
        alerts: AlertMarks | None = None,
    ) -> int:
        if not record_id:
            raise ValueError("record_id must not be empty")
        if amount is not None:
            _check_amount(amount)
        if tokens is not None:
            _check_amount(tokens)
        for key in rate_keys:
            rate = self._rates.get(key)
            if rate is not None and withdrawn is not None:
                # Refused after all (another check's slot): its request count goes too.
                if withdrawn == rate.minute:
                    rate.requests = max(0, rate.requests - 1)
                elif withdrawn == rate.minute - 1:
                    rate.prev_requests = max(0, rate.prev_requests - 1)
            slot = None if rate is None else rate.slots.pop(record_id, None)
            if rate is None or slot is None:
                continue
            if not rate.slots:
                rate.earliest = None
            _, minute, reserved = slot
            if reserved is None:
                continue
            # True up the reservation in the minute it was made, while that minute counts.
            delta = (tokens or 0) - reserved
            if minute == rate.minute:
                rate.tokens = max(0, rate.tokens + delta)
            elif minute == rate.minute - 1:
                rate.prev_tokens = max(0, rate.prev_tokens + delta)
        now = self._clock()
        applied = 0
        for key in usage_keys:
            usage = self._live_usage(key, now)
            if usage is not None and record_id in usage.holds:
                usage.pending -= usage.holds.pop(record_id)
            if (
                amount is None
                or usage is None
                or record_id in usage.markers
                or record_id in usage.tombstones
            ):
                continue
            usage.markers[record_id] = amount
            usage.pending += amount
            applied += 1
        if entry_key is not None:
            entries = self._entries.get(entry_key, {})
            if not closed:
                entries.pop(record_id, None)
            elif record_id in entries:
                entries[record_id] = closed
        if alerts is not None:
            alerts.fired = self._alert(alerts, usage_keys, now)
        return applied

    def _alert(self, alerts: AlertMarks, usage_keys: Sequence[str], now: datetime) -> int:
        fired, looked = 0, set()
        for key, marks in zip(usage_keys, alerts.marks, strict=False):
            usage = self._live_usage(key, now)
            if marks is None or usage is None or key in looked:
                continue
            looked.add(key)
            limit, at = marks
            used = usage.settled + usage.pending
            label = key.partition(":spend:usage:")[2]
            if not label:
                label = "balance" if key.endswith(":spend:balance") else key
            for pct, amount in at:
                mark = f"{pct}:{limit}"
                if used >= amount and mark not in usage.alerted:
                    usage.alerted.add(mark)
                    pending = self._alerts.setdefault(alerts.key, {})
                    pending[f"{label} {pct} {limit}"] = f"{used} {to_millis(now)}"
                    fired += 1
        return fired

    async def pending_alerts(self, alerts_key: str) -> dict[str, str]:
        return dict(self._alerts.get(alerts_key, {}))

    async def drop_alerts(self, alerts_key: str, fields: Sequence[str]) -> None:
        pending = self._alerts.get(alerts_key, {})
        for name in fields:
            pending.pop(name, None)
        if not pending:
            self._alerts.pop(alerts_key, None)

    async def open_entries(self, entries_key: str) -> dict[str, str]:
        return dict(self._entries.get(entries_key, {}))

    async def close_entries(self, by_key: Mapping[str, Sequence[str]]) -> None:
        for key, ids in by_key.items():
            entries = self._entries.get(key, {})
            for rid in ids:
                entries.pop(rid, None)

    async def refresh(self, entries: Sequence[RefreshEntry]) -> None:
        for entry in entries:
            _check_amount(entry.settled)
            if entry.limit is not None:
                _check_amount(entry.limit)
        now = self._clock()
        for entry in entries:
            usage = self._live_usage(entry.usage_key, now)
            if usage is None:
                continue
            for rid in (*entry.applied, *entry.unknown):
                hold = usage.holds.pop(rid, None)  # a hold outlives no settled record
                if hold is not None:
                    usage.pending -= hold
                estimate = usage.markers.pop(rid, None)
                if estimate is not None:
                    usage.pending -= estimate
                elif rid in entry.unknown:
                    usage.tombstones.add(rid)
            usage.settled = max(usage.settled, entry.settled)
            if entry.limit is not None:
                usage.limit = max(usage.limit or 0, entry.limit)

    async def pending_records(self, usage_keys: Sequence[str]) -> dict[str, list[str]]:
        now = self._clock()
        out: dict[str, list[str]] = {}
        for key in usage_keys:
            usage = self._live_usage(key, now)
            if usage is not None:
                out[key] = list(usage.markers)
        return out

    async def evict_policy(self, policy_key: str) -> None:
        self._policies.pop(policy_key, None)

    async def read_parts(self, usage_keys: Sequence[str]) -> dict[str, CachedParts | None]:
        now = self._clock()
        out: dict[str, CachedParts | None] = {}
        for key in usage_keys:
            usage = self._live_usage(key, now)
            if usage is None:
                out[key] = None
                continue
            held = sum(usage.holds.values())
            out[key] = CachedParts(usage.settled, usage.pending - held, held)
        return out

    async def read_usage(self, usage_keys: Sequence[str]) -> dict[str, int | None]:
        now = self._clock()
        out: dict[str, int | None] = {}
        for key in usage_keys:
            usage = self._live_usage(key, now)
            out[key] = None if usage is None else usage.settled + usage.pending
        return out

    # -- rolling windows --------------------------------------------------------------------
    def _bucket(self, bucket: Bucket, now_ms: int) -> _Bucket:
        found = self._buckets.get(bucket)
        if found is not None:
            return found
        if len(self) >= self._max_keys:
            self._sweep_buckets(now_ms)
            self._make_room(1, self._clock())
        found = self._buckets[bucket] = _Bucket()
        return found

    def _sweep_buckets(self, now_ms: int) -> None:
        """Forget buckets whose windows have drained and whose holds have ended."""
        for bucket, state in list(self._buckets.items()):
            state.prune(now_ms)
            for window_key, slices in state.windows.items():
                # A calendar window's slice is a day, and a day is its least; a rolling one's
                # is 1/60 of its seconds. What still counts in either is kept.
                label = window_key[1]
                if label.isdigit():
                    slices.drop_before(now_ms // (int(label) * 1000 // SLICES) - SLICES + 1)
                else:
                    slices.drop_before(now_ms // DAY_MS - 31)
            if state.empty:
                del self._buckets[bucket]

    def reserve_buckets(
        self, calls: Sequence[BucketCheck], hold: Hold, *, require_seed: bool = False
    ) -> Awaitable[list[Reserved]]:
        # Never unseeded: a process's counters live and die with it. Each bucket is decided
        # on its own (as each is its own script on Redis), all of them now.
        try:
            return _ready([self._reserve(call, hold) for call in calls])
        except StoreFull as exc:
            return _failed(exc)

    def _reserve(self, call: BucketCheck, hold: Hold) -> Reserved:
        state = self._bucket(call.bucket, hold.now_ms)
        held_t, held_c = state.prune(hold.now_ms)
        held_r = len(state.holds)  # every hold is one request
        used: list[int] = []
        for i, check in enumerate(call.checks):
            slices = state.slices(check.window)
            tokens, cost, requests = slices.current(check.window, hold.now_ms)
            limit = check.limit
            if limit.tokens is not None and tokens + held_t + hold.tokens > limit.tokens:
                held = tokens + held_t
                wait = retry_ms(
                    slices.tokens, check.window, hold.now_ms, held, hold.tokens, limit.tokens
                )
                return self._denied(call, state, hold, i, Unit.TOKENS, wait, (held_t, held_c))
            if (
                hold.count_cost
                and limit.cost_micros is not None
                and cost + held_c + hold.cost > limit.cost_micros
            ):
                held = cost + held_c
                wait = retry_ms(
                    slices.cost, check.window, hold.now_ms, held, hold.cost, limit.cost_micros
                )
                return self._denied(call, state, hold, i, Unit.USD, wait, (held_t, held_c))
            if limit.requests is not None and requests + held_r + 1 > limit.requests:
                held = requests + held_r
                wait = retry_ms(slices.requests, check.window, hold.now_ms, held, 1, limit.requests)
                return self._denied(call, state, hold, i, Unit.REQUESTS, wait, (held_t, held_c))
            used.append(tokens + held_t + hold.tokens)
        state.holds[hold.id] = (hold.expires_ms, hold.tokens, hold.cost)
        return Reserved(True, tuple(used))

    @staticmethod
    def _denied(
        call: BucketCheck,
        state: _Bucket,
        hold: Hold,
        window: int,
        unit: Unit,
        wait: int,
        held: tuple[int, int],
    ) -> Reserved:
        """bucket_reserve.lua's denial: the least left in any window, per unit."""
        left_t: int | None = None
        left_c: int | None = None
        for check in call.checks:
            tokens, cost, _ = state.slices(check.window).current(check.window, hold.now_ms)
            limit = check.limit
            if limit.tokens is not None:
                left = max(0, limit.tokens - tokens - held[0])
                left_t = left if left_t is None else min(left_t, left)
            if hold.count_cost and limit.cost_micros is not None:
                left = max(0, limit.cost_micros - cost - held[1])
                left_c = left if left_c is None else min(left_c, left)
        return Reserved(
            False, window=window, unit=unit, retry_ms=wait, left_tokens=left_t, left_cost=left_c
        )

    def commit_buckets(
        self,
        calls: Sequence[BucketCheck],
        hold_id: str,
        *,
        now_ms: int,
        at_ms: int,
        tokens: int,
        cost: int,
        ttl_ms: int,
        held_only: bool = False,
    ) -> Awaitable[list[int]]:
        fired: list[int] = []
        try:
            for call in calls:
                state = self._bucket(call.bucket, now_ms)
                if state.holds.pop(hold_id, None) is None and held_only:
                    fired.append(0)
                    continue
                self._count(call, state, now_ms, at_ms, tokens, cost)
                fired.append(self._bucket_alert(call, state, now_ms))
        except StoreFull as exc:
            return _failed(exc)
        return _ready(fired)

    def commit_holds(
        self, call: BucketCheck, commits: Sequence[Commit], *, now_ms: int, ttl_ms: int
    ) -> Awaitable[int]:
        try:
            state = self._bucket(call.bucket, now_ms)
            for c in commits:
                state.holds.pop(c.hold_id, None)
                self._count(call, state, now_ms, c.at_ms, c.tokens, c.cost)
            fired = self._bucket_alert(call, state, now_ms)
        except StoreFull as exc:
            return _failed(exc)
        return _ready(fired)

    def bucket_alerts_key(self, bucket: Bucket) -> str:
        return f"{{{bucket.tag}}}:budget:alerts"

    @staticmethod
    def _count(
        call: BucketCheck, state: _Bucket, now_ms: int, at_ms: int, tokens: int, cost: int
    ) -> None:
        """One request's usage, in the slice of ``at_ms`` of every window still holding it."""
        for window in call.windows:
            idx = at_ms // window.slice_ms
            if idx < window.first_slice(now_ms):
                continue  # the request's slice already left this window
            slices = state.slices(window)
            slices.tokens[idx] = slices.tokens.get(idx, 0) + tokens
            slices.cost[idx] = slices.cost.get(idx, 0) + cost
            slices.requests[idx] = slices.requests.get(idx, 0) + 1

    def _bucket_alert(self, call: BucketCheck, state: _Bucket, now_ms: int) -> int:
        """bucket_commit.lua's thresholds, on the same integers."""
        fired = 0
        for check in call.checks:
            marks = limit_marks(check.limit)
            if not marks:
                continue
            window = check.window
            epoch = str(window.epoch(now_ms))
            slices = state.slices(window)
            tokens, cost, requests = slices.current(window, now_ms)
            for unit, pct, amount, at in marks:
                used = tokens if unit == "t" else cost if unit == "c" else requests
                mark = f"{unit}{pct}:{amount}"
                if used >= at and slices.alerted.get(mark) != epoch:
                    slices.alerted[mark] = epoch
                    pending = self._alerts.setdefault(self.bucket_alerts_key(call.bucket), {})
                    name = f"{window.id} {unit} {pct} {amount} {epoch}"
                    pending[name] = f"{used} {now_ms}"
                    fired += 1
        return fired

    def release_buckets(self, buckets: Sequence[Bucket], hold_id: str) -> Awaitable[None]:
        for bucket in buckets:
            state = self._buckets.get(bucket)
            if state is not None:
                state.holds.pop(hold_id, None)
        return _ready(None)

    def stock_bucket(
        self,
        call: BucketCheck,
        hold: Hold,
        ids: Sequence[str],
        share: int,
        *,
        require_seed: bool = False,
    ) -> Awaitable[int]:
        """bucket_stock.lua's rule, on the same integers."""
        try:
            state = self._bucket(call.bucket, hold.now_ms)
        except StoreFull as exc:
            return _failed(exc)
        held_t, held_c = state.prune(hold.now_ms)
        held_r = len(state.holds)
        most = len(ids)

        def fit(free: int, amount: int) -> None:
            nonlocal most
            if amount > 0:
                most = min(most, max(0, free) // (amount * (share + 1)))

        for check in call.checks:
            tokens, cost, requests = state.slices(check.window).current(check.window, hold.now_ms)
            limit = check.limit
            if limit.tokens is not None:
                fit(limit.tokens - tokens - held_t, hold.tokens)
            if hold.count_cost and limit.cost_micros is not None:
                fit(limit.cost_micros - cost - held_c, hold.cost)
            if limit.requests is not None:
                fit(limit.requests - requests - held_r, 1)
        for stock_id in ids[:most]:
            state.holds[stock_id] = (hold.expires_ms, hold.tokens, hold.cost)
        return _ready(most)

    def release_stock(self, bucket: Bucket, ids: Sequence[str]) -> Awaitable[int]:
        state = self._buckets.get(bucket)
        if state is None:
            return _ready(0)
        return _ready(sum(state.holds.pop(i, None) is not None for i in ids))

    async def seed_bucket(
        self, call: BucketCheck, slices: Sequence[Sequence[SeedSlice]], ttl_ms: int
    ) -> bool:
        return False  # never unseeded (see reserve_buckets)

    async def inspect_bucket(self, call: BucketCheck, now_ms: int) -> BucketUsage:
        state = self._buckets.get(call.bucket) or _Bucket()
        held_t, held_c = state.prune(now_ms)
        rows = []
        for window in call.windows:
            slices = state.windows.get(_window_key(window)) or _Slices()
            rows.append(WindowUsage(window, *slices.current(window, now_ms)))
        return BucketUsage(call.bucket, held_t, held_c, tuple(rows), len(state.holds))

    async def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    async def reset_bucket(self, bucket: Bucket, windows: Sequence[Rolling]) -> None:
        state = self._buckets.get(bucket)
        if state is not None:
            for window in windows:
                state.windows.pop(_window_key(window), None)

    # -- provider capacity ------------------------------------------------------------------
    async def register_key(self, key: ProviderKey) -> None:
        found = self._provider_keys.get(key.id)
        if found is None:
            self._provider_keys[key.id] = _ProviderKey(key.provider, key.tpm, key.rpm)
        else:
            found.provider, found.tpm, found.rpm = key.provider, key.tpm, key.rpm

    async def remove_key(self, key_id: str) -> None:
        self._provider_keys.pop(key_id, None)

    def acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Awaitable[Acquired]:
        refused: list[Attempt] = []
        for i, key_id in enumerate(key_ids):
            key = self._provider_keys.get(key_id)
            attempt = Attempt(Refusal.UNKNOWN) if key is None else key.attempt(tokens, now_ms)
            if attempt.granted:
                return _ready(Acquired(i, attempt.window))
            refused.append(attempt)
        return _ready(Acquired(None, refused=tuple(refused)))

    def settle_lease(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> Awaitable[None]:
        return self.settle_leases(key_id, ((window, reserved, actual),), now_ms)

    def settle_leases(
        self, key_id: str, leases: Sequence[tuple[int, int, int | None]], now_ms: int
    ) -> Awaitable[None]:
        for window, reserved, actual in leases:
            self._settle(key_id, window, reserved, actual, now_ms)
        return _ready(None)

    def _settle(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> None:
        key = self._provider_keys.get(key_id)
        current = now_ms // WINDOW_MS
        if key is None:
            pass
        elif window == current and key.window == current:
            if actual is None:
                key.requests = max(0, key.requests - 1)
                key.tokens = max(0, key.tokens - reserved)
            else:
                key.tokens = max(0, key.tokens - reserved + actual)
        elif actual is not None and actual > reserved:
            key.open(current)
            key.tokens += actual - reserved

    async def cooldown(self, key_id: str, until_ms: int) -> int | None:
        key = self._provider_keys.get(key_id)
        if key is None:
            return None
        key.cooling_until = max(key.cooling_until, until_ms)
        return key.cooling_until

    async def key_state(self, key_id: str, now_ms: int) -> StoredKey | None:
        key = self._provider_keys.get(key_id)
        if key is None:
            return None
        live = key.window == now_ms // WINDOW_MS
        return StoredKey(
            key.provider,
            key.tpm,
            key.rpm,
            key.requests if live else 0,
            key.tokens if live else 0,
            key.cooling_until,
        )

    async def aclose(self) -> None:
        self._buckets.clear()
        self._provider_keys.clear()
        self._usage.clear()
        self._policies.clear()
        self._rates.clear()

    def __len__(self) -> int:
        return len(self._usage) + len(self._policies) + len(self._rates) + len(self._buckets)


T = TypeVar("T")


async def _ready(value: T) -> T:
    """An answer already decided: the call is as atomic as a script, and its awaitable has it."""
    return value


async def _failed(exc: Exception) -> Any:
    """A call that failed when it was made: its awaitable raises, as a script's reply would."""
    raise exc


def _check_amount(value: int) -> None:
    # Same validation the Lua scripts do before their first write: integers only, never floats.
    if type(value) is int and value >= 0:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"amount must be a non-negative integer of micro-USD, got {value!r}")
