"""The store Protocol: the gateway's one cache of policies, usage and capacity, one atomic call
per decision.

One Protocol for every limit kind (``limits/kinds.py``): the spend limits' keys (policies,
usage, holds, rates, model lists, admission entries), the budgets' rolling-window buckets and
the provider keys' capacity. Two implementations pass one contract suite
(``tests/store/test_contract*.py`` on the harness of ``tests/store/conftest.py``): the embedded
:class:`~spendguard.store.memory.MemoryStore` and the Redis store, whose every method is one
Lua script in one slot. The store speaks the cache's language (key names and policy-hash
fields, made by :mod:`spendguard.limits.codec`, and the values of
:mod:`spendguard.store.rolling` and :mod:`spendguard.limits.capacity`). The spend semantics,
shared by both (design.md, "Invariants"):

- A usage key holds ``settled`` (the ledger's aggregate), ``pending`` (the sum of estimates of
  records postflight applied that settlement has not yet folded in) and one marker per such
  record holding its estimate. Usage = settled + pending, so there is no under-count gap
  between a postflight and the settlement that folds it in.
- ``preflight`` reads, never writes. It reports a miss (policy hash or usage key absent)
  instead of guessing; the caller loads from the ledger and calls ``fill``.
- ``fill`` writes only keys that are absent (never overwrites what postflight added) and never
  creates the key of a period already closed past its grace.
- ``postflight`` validates everything first, then adds the estimate only to usage keys that
  exist; it never creates a key from 0 and applies a record at most once per key.
- ``refresh`` (settlement) replaces ``settled`` and removes exactly the markers of the settled
  records, subtracting each marker's own estimate: running it twice changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol, runtime_checkable

from ..limits import Balance, Check, KeyPlan
from ..limits.capacity import Acquired, ProviderKey, StoredKey
from ..limits.model import SubjectKind
from ..limits.rates import RATE_SUBJECTS, RateDenial, RateKind, RateState, parse_state
from ..limits.windows import Rolling
from .rolling import Bucket, BucketCheck, BucketUsage, Commit, Hold, Reserved, SeedSlice


class Outcome(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    MISS = "miss"
    MODEL = "model"  # the model is on none of the lists that apply: nothing was checked
    RATE = "rate"  # every limit allows, a rate (RPM, TPM, parallel) does not: nothing written


# Made on every request: not frozen, since a frozen dataclass's __init__ sets each field
# through object.__setattr__ (about 7x the cost). Hashed and compared by value like one;
# never assigned to after it is made.
@dataclass(slots=True, unsafe_hash=True)
class LimitState:
    check: Check
    limit: int  # micro-USD (a balance: topped up)
    used: int  # micro-USD: settled + pending (holds included)
    hard: bool = False  # a hard limit: a request must fit its hold under it
    # The limit's own alert thresholds as stored ("50,80"; "" none), None: the gateway's.
    alert_at: str | None = None
    fit: bool = False  # a hard limit that fits a refused request's output cap (its opt-in)

    @property
    def is_balance(self) -> bool:
        return isinstance(self.check.target, Balance)


# Made on every request: not frozen, since a frozen dataclass's __init__ sets each field
# through object.__setattr__ (about 7x the cost). Hashed and compared by value like one;
# never assigned to after it is made.
@dataclass(slots=True, unsafe_hash=True)
class Preflight:
    outcome: Outcome
    # Policy-bearing limits the store checked, in check order. On ALLOW these are the usage
    # keys postflight will charge; on DENY the last one is the limit that denied.
    limits: tuple[LimitState, ...] = ()
    missing_policy: bool = False
    missing_usage: tuple[Check, ...] = ()
    # The rated scopes (the key's, then the team's), counted when allowed; the rate that denied.
    rates: tuple[RateState, ...] = ()
    rate_denied: RateDenial | None = None

    @property
    def denied(self) -> LimitState | None:
        return self.limits[-1] if self.outcome is Outcome.DENY else None


def with_rates(
    pf: Preflight, denial: str | None, states: Sequence[str | None], now_ms: int, tokens: int
) -> Preflight:
    """A preflight's spend answer with the rates part of the store's reply: the denying rate
    (``"key:rpm"``, ``"team:par"``, ...) or None, and each scope's state (key, team) or None."""
    key_raw, team_raw = states
    rates: tuple[RateState, ...] = ()
    if key_raw is not None:
        rates = (parse_state(SubjectKind.API_KEY, key_raw, now_ms),)
    if team_raw is not None:
        rates = (*rates, parse_state(SubjectKind.TEAM, team_raw, now_ms))
    if denial is None or pf.outcome is not Outcome.ALLOW:
        # ``pf`` is the caller's, made for this answer and not yet handed on: completed in
        # place rather than made twice (this runs on every rated request).
        pf.rates = rates
        return pf
    name, kind = denial.split(":")
    scope = RATE_SUBJECTS[name]
    state = next(r for r in rates if r.scope is scope)
    rate = RateKind(kind)
    cost = tokens if rate is RateKind.TPM else 1
    denied = RateDenial(state, rate, cost)
    return Preflight(Outcome.RATE, pf.limits, rates=rates, rate_denied=denied)


@dataclass(frozen=True, slots=True)
class RefreshEntry:
    usage_key: str
    settled: int
    applied: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    limit: int | None = None  # the balance key's topped-up total (also never lowered)


@dataclass(frozen=True, slots=True)
class UsageFill:
    usage_key: str
    settled: int
    expires_at: datetime
    limit: int | None = None  # the balance key's topped-up total


@dataclass(frozen=True, slots=True)
class CachedParts:
    """A usage key's parts: usage = settled + pending + held."""

    settled: int
    pending: int  # estimates of finished inferences not settled yet
    held: int  # holds of running inferences on a hard limit


@dataclass(slots=True)
class AlertMarks:
    """What one postflight checks for threshold alerts: ``key``, the team's pending alerts
    hash, and per usage key of the call (in order) None or its limit and the (percent,
    amount) pairs it alerts at. The store sets ``fired``: how many alerts the call fired.

    A usage key whose usage (settled + pending, in-flight holds included) is at or past an
    amount fires it once per limit amount and window: the alert waits in ``key`` (field
    ``"<usage key's field and bucket> <percent> <limit>"``, value ``"<used> <epoch ms>"``)
    until :meth:`Store.drop_alerts` forgets it, once the ledger's outbox holds it."""

    key: str
    marks: Sequence[tuple[int, tuple[tuple[int, int], ...]] | None]
    fired: int = 0


# Made on every request of a shared store: not frozen, as LimitState.
@dataclass(slots=True, unsafe_hash=True)
class EntryWrite:
    """An admission entry for preflight to write if, and only if, it allows the request."""

    key: str  # the team's entries hash
    record_id: str
    value: str


# A check as a store read it: (check, limit or None, usage or None, mode, own alert
# thresholds or None); mode: 0 soft, 1 hard, 2 hard and fitting (HARD, FITS).
Found = tuple[Check, int | None, int | None, int, str | None]
HARD, FITS = 1, 2


def decide(checks: Sequence[Found], hold: int = 0) -> Preflight:
    """The preflight rule shared by every store, on exact integers.

    ``checks`` holds, in check order, (check, limit or None for no policy, usage or None
    for an absent key, hard, the limit's own alert thresholds or None). The first soft limit
    with usage >= limit, or hard limit with usage + ``hold`` > limit, denies; otherwise any
    absent key of a policy-bearing check is a miss; otherwise the request is allowed (and
    holds ``hold`` in every hard limit). A balance is the same comparison (limit = topped up,
    usage = charges settled plus pending), so a soft one denies once nothing is left, a hard
    one once the hold no longer fits.
    """
    checked: list[LimitState] = []
    missing: list[Check] = []
    for check, limit, used, mode, alert_at in checks:
        if limit is None:
            continue
        if used is None:
            missing.append(check)
            continue
        hard = mode != 0
        state = LimitState(check, limit, used, hard, alert_at, mode == FITS)
        checked.append(state)
        if used + hold > limit if hard else used >= limit:
            return Preflight(Outcome.DENY, tuple(checked))
    if missing:
        return Preflight(Outcome.MISS, tuple(checked), missing_usage=tuple(missing))
    return Preflight(Outcome.ALLOW, tuple(checked))


@runtime_checkable
class Store(Protocol):
    # Whether other processes see this store (Redis) or it lives inside one process (the
    # embedded store): a CLI only talks to a shared store.
    shared: bool

    async def start(self) -> None:
        """Checks worth a warning at start (e.g. an eviction policy that can drop keys)."""
        ...

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
        """Check every policy-bearing check of ``plan``; one round trip. With ``model``,
        first the model lists of the plan's team and key (MODEL: none admits it). When every
        limit allows, the rates of the plan's key and team at ``now_ms`` (RATE: one does not;
        ``tokens`` is what a TPM rate reserves). An ALLOW also, in the same atomic step, holds
        ``hold`` for ``record_id`` (or ``entry``'s) in every hard limit, counts the request in
        its rates (in flight for at most ``slot_ttl_ms``) and writes ``entry``."""
        ...

    async def fill(
        self,
        plan: KeyPlan,
        policies: Mapping[str, int | str] | None,
        usage: Sequence[UsageFill],
        *,
        policy_ttl: float,
    ) -> None:
        """Fill absent keys after a miss. ``policies`` is the team's whole policy hash
        (field -> limit; empty = "no policy", cached negatively); None leaves it alone."""
        ...

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
        """Add ``amount`` to the existing ``usage_keys`` once; returns how many were charged.
        The record's holds in those keys are released first (``amount`` None: only that).

        In each of ``rate_keys`` the record stops being in flight, and a TPM reservation is
        trued up to ``tokens`` (None: released). ``withdrawn``: the minute (epoch ms // 60000)
        the admission counted the request in, when a check of another slot refused it after
        all: its request count in that minute is taken back too (never below 0).

        With ``entry_key``, the record's admission entry is closed in the same step: replaced
        by ``closed`` if it still exists, or removed when ``closed`` is empty.

        With ``alerts``, the thresholds those keys reach fire in the same step (see
        :class:`AlertMarks`)."""
        ...

    async def pending_alerts(self, alerts_key: str) -> dict[str, str]:
        """The alerts fired and not handed on yet: field -> value (see :class:`AlertMarks`)."""
        ...

    async def drop_alerts(self, alerts_key: str, fields: Sequence[str]) -> None:
        """Forget alerts the ledger's outbox holds now."""
        ...

    async def open_entries(self, entries_key: str) -> dict[str, str]:
        """Every admission entry of one team: record id -> value."""
        ...

    async def close_entries(self, by_key: Mapping[str, Sequence[str]]) -> None:
        """Remove admission entries (their records are in the ledger): entries key -> ids."""
        ...

    async def refresh(self, entries: Sequence[RefreshEntry]) -> None:
        """Settlement's cache refresh for one team's keys (absent keys stay absent).

        Per key: raise ``settled`` to the ledger's aggregate (never lower it: aggregates only
        grow, and a late refresh from an older read must not undo a newer one); drop the
        markers of ``applied`` records, subtracting each marker's estimate; for ``unknown``
        records (postflight outcome unknown) drop the marker if there is one, else leave a
        tombstone so a postflight landing later adds nothing.
        """
        ...

    async def pending_records(self, usage_keys: Sequence[str]) -> dict[str, list[str]]:
        """Record ids with a pending estimate (a marker) in each existing key. Off the hot path
        (a reconcile): a shared store reads them in short pages, so that no single call holds
        it however many markers wait. Settlement drops those the ledger has settled."""
        ...

    async def evict_policy(self, policy_key: str) -> None:
        """Drop a cached policy hash now (spendguard's own policy changes)."""
        ...

    async def read_parts(self, usage_keys: Sequence[str]) -> dict[str, CachedParts | None]:
        """Each key's settled part, its pending estimates and its holds (None: absent); for
        the CLI and tests."""
        ...

    async def read_usage(self, usage_keys: Sequence[str]) -> dict[str, int | None]:
        """Cached usage (settled + pending) per key, None when absent; for the CLI and tests."""
        ...

    # -- rolling windows (budgets; :mod:`spendguard.store.rolling`) --------------------------
    # The request path's calls are sent before they return (on Redis into the pipeline's
    # next write, so they cost no round trip of their own); the awaitable they return has
    # the answer, and must be awaited.
    def reserve_buckets(
        self, calls: Sequence[BucketCheck], hold: Hold, *, require_seed: bool = False
    ) -> Awaitable[list[Reserved]]:
        """Reserve ``hold`` in each bucket where every window can afford it (each bucket on
        its own, atomically); one answer per call, in order. ``require_seed``: a bucket the
        store has no seed marker for (Redis lost it) is answered ``unseeded``, nothing held."""
        ...

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
        """Replace the hold by the actual usage, counted in the slice of ``at_ms``; returns
        how many alerts each call fired. In the same step, a window whose committed usage
        reached one of its limit's alert thresholds (``BudgetLimit.alert_at``) fires it, at
        most once per epoch of the window's length (``now_ms // period_ms``): the alert waits
        in :meth:`bucket_alerts_key` (:meth:`pending_alerts`, field ``"<window id> <t|c>
        <percent> <amount> <epoch>"``, value ``"<used> <epoch ms>"``).

        ``held_only``: count the usage only in the buckets that still hold ``hold_id`` (the
        recovery of a dead gateway's admission: counted once, however often it is recovered,
        and not at all where the admission's own commit ran)."""
        ...

    def commit_holds(
        self, call: BucketCheck, commits: Sequence[Commit], *, now_ms: int, ttl_ms: int
    ) -> Awaitable[int]:
        """:meth:`commit_buckets` of several holds in one bucket, in one step: as if each were
        committed in turn (thresholds checked once, after all of them); returns how many
        alerts fired. The finishes a gateway carried together (engine/carryover.py)."""
        ...

    def bucket_alerts_key(self, bucket: Bucket) -> str:
        """Where ``bucket``'s fired alerts wait (its slot)."""
        ...

    def release_buckets(self, buckets: Sequence[Bucket], hold_id: str) -> Awaitable[object]:
        """Return the hold (nothing is counted)."""
        ...

    def stock_bucket(
        self,
        call: BucketCheck,
        hold: Hold,
        ids: Sequence[str],
        share: int,
        *,
        require_seed: bool = False,
    ) -> Awaitable[int]:
        """Reserve holds of ``hold``'s size and expiry under ``ids`` ahead of the requests that
        will take them (``hold.id`` unused), atomically: the first *m* of them, *m* the most
        that every window of ``call`` affords while what is then free stays at least ``share``
        times what they take. Returns *m*; -1, nothing held, for a bucket without a seed
        marker when ``require_seed``. Each is a hold like :meth:`reserve_buckets`' own: one
        request, committed, released or expired by its id."""
        ...

    def release_stock(self, bucket: Bucket, ids: Sequence[str]) -> Awaitable[int]:
        """Return stocked holds no request took; how many were still there."""
        ...

    async def inspect_bucket(self, call: BucketCheck, now_ms: int) -> BucketUsage: ...

    async def reset_bucket(self, bucket: Bucket, windows: Sequence[Rolling]) -> None:
        """Forget the committed usage of ``windows`` (holds stay: their requests still end)."""
        ...

    async def seed_bucket(
        self, call: BucketCheck, slices: Sequence[Sequence[SeedSlice]], ttl_ms: int
    ) -> bool:
        """Fill a bucket the store lost with rebuilt usage: per window, (slice index, tokens,
        cost, requests). False when another process seeded it first (nothing written)."""
        ...

    async def buckets(self) -> list[Bucket]:
        """Every bucket the store has counters for."""
        ...

    # -- provider capacity (design.md, "Provider keys") --------------------------------------
    # A provider key holds its capacity (rpm, tpm; absent: unlimited), the counters of one
    # rate window (requests, tokens, and which window they belong to) and the end of its
    # cooldown. Counters of a window that is over read as 0. Time is always the caller's.
    async def register_key(self, key: ProviderKey) -> None:
        """Set provider and capacity; the counters and the cooldown stay, so re-registering
        at start (every replica does) never resets a window."""
        ...

    async def remove_key(self, key_id: str) -> None: ...

    def acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Awaitable[Acquired]:
        """Reserve 1 request and ``tokens`` in the current window on the first candidate, in
        order, that is registered, not cooling down and where both fit (``requests + 1 <=
        rpm``, ``tokens_used + tokens <= tpm``): choice, check and reservation are one step.
        Sent at once (on Redis, in the next pipeline write); await the answer."""
        ...

    def settle_lease(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> Awaitable[object]:
        """In the lease's window, replace the reservation with the ``actual`` tokens (never
        below 0); in a later window add only what the call used beyond its reservation, to the
        current window. ``actual`` None releases: in the lease's window the request and the
        reserved tokens are given back; later, nothing is left to give. Sent at once."""
        ...

    def settle_leases(
        self, key_id: str, leases: Sequence[tuple[int, int, int | None]], now_ms: int
    ) -> Awaitable[object]:
        """:meth:`settle_lease` of several leases on one key, each ``(window, reserved,
        actual)``, in turn, in one step (``settle_lease`` is this of one): the settlements a
        gateway carried together (engine/carryover.py). Sent at once."""
        ...

    async def cooldown(self, key_id: str, until_ms: int) -> int | None:
        """Move the key's cooldown end to the later of the stored and the given time (a
        replica never shortens another's); the end after this call, None if unregistered."""
        ...

    async def key_state(self, key_id: str, now_ms: int) -> StoredKey | None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class OwnerLog(Protocol):
    """Which gateway processes are alive, for a shared store's admission entries: each owner
    heartbeats a key with a TTL and lists the teams it wrote entries for."""

    async def heartbeat(self, owners_key: str, alive_key: str, owner: str, ttl_ms: int) -> None:
        """Mark ``owner`` alive for ``ttl_ms`` and listed among the owners."""
        ...

    async def add_member(self, key: str, member: str) -> None: ...

    async def members(self, key: str) -> list[str]: ...

    async def exists(self, key: str) -> bool: ...

    async def remove_member(self, key: str, member: str) -> None: ...

    async def delete(self, *keys: str) -> None: ...
