"""Rolling-window counters: what the store keeps for token and USD budgets, and its answers.

A *bucket* is one subject's counters (a key, a model, the fleet). For each window it keeps the
committed usage in :data:`~spendguard.limits.windows.SLICES` slices of ``period / SLICES``; a
slice leaves the window as a whole when the window has moved past it, so usage drains slice by
slice and a 24h window always holds (about) the last 24 hours. In flight requests are *holds*:
an admission estimate reserved in the bucket (counted in every window) until the response ends
and the hold is replaced by the actual usage, or returned. A hold also expires by itself after
its ``expires_ms``, so a gateway that dies mid-request cannot keep budget reserved.

Each call on one bucket is atomic (one Lua script on Redis: a bucket's keys share one slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final, NamedTuple

from ..limits.model import BudgetLimit, SubjectKind, Unit
from ..limits.windows import SLICES, Rolling


@dataclass(frozen=True, slots=True)
class Bucket:
    """One subject's counters: an API key (``subject`` = ``team:key``, encoded), an end user
    (``team:end user``, encoded), a tag or a model (its encoded name) or the fleet (``''``)."""

    kind: SubjectKind
    subject: str

    @property
    def tag(self) -> str:
        """The bucket's name (``bk:acme:alpha``): its keys' hash tag where it has a slot of
        its own, and its label in alerts."""
        return BUCKET_TAGS[self.kind] + (f":{self.subject}" if self.subject else "")

    @property
    def slot(self) -> str:
        """The Redis Cluster hash tag its keys live under. A key's and an end user's bucket
        live in their team's slot, beside its spend keys; the model's and the fleet's in the
        one slot every gateway shares, beside the provider pool. So a request's round touches
        at most two slots (its team's and the shared one) whatever is configured, and a
        Cluster round writes to at most two nodes. A tag's or a customer's bucket spans teams
        and has a slot of its own."""
        kind = self.kind
        if kind is SubjectKind.API_KEY or kind is SubjectKind.END_USER:
            return self.subject.partition(":")[0]
        if kind is SubjectKind.MODEL or kind is SubjectKind.FLEET:
            return SHARED_SLOT
        return self.tag


BUCKET_TAGS: Final = {
    SubjectKind.API_KEY: "bk",
    SubjectKind.END_USER: "bu",
    SubjectKind.TAG: "bt",
    SubjectKind.CUSTOMER: "bc",
    SubjectKind.MODEL: "bm",
    SubjectKind.FLEET: "bg",
}
"""A bucket's kind in its name (``bk:acme:alpha``), and back."""
SHARED_SLOT: Final = "pool"
"""The hash tag of what every gateway shares: the provider pool's keys (which have always lived
under it, so a registered key survives an upgrade) and the model's and the fleet's buckets."""


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class WindowCheck:
    window: Rolling
    limit: BudgetLimit


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class BucketCheck:
    """One bucket and the limits that apply to it, window by window (in config order)."""

    bucket: Bucket
    checks: tuple[WindowCheck, ...]
    # The checks' windows, in order; made once (a gate reuses a plan's checks per request).
    windows: tuple[Rolling, ...] = field(init=False, compare=False)
    calendar: bool = field(init=False, compare=False)  # any window a calendar one

    def __post_init__(self) -> None:
        self.windows = tuple(c.window for c in self.checks)
        self.calendar = any(w.calendar is not None for w in self.windows)


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Hold:
    """What one admission reserves: ``tokens`` and ``cost`` (micro-USD) until ``expires_ms``.
    ``count_cost`` is False for a model without a price: cost limits don't apply to it."""

    id: str
    now_ms: int
    expires_ms: int
    tokens: int
    cost: int
    count_cost: bool
    ttl_ms: int  # how long the bucket's keys live: the longest window plus the hold time


class Commit(NamedTuple):
    """A finished request's hold replaced by what it used: ``tokens``, ``cost`` (micro-USD)
    and one request, counted in the slice of ``at_ms`` (the request's start)."""

    hold_id: str
    at_ms: int
    tokens: int
    cost: int


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class Reserved:
    """A bucket's answer. Admitted: ``used_tokens`` per window, this hold included. Denied: the
    first window (index) and unit that can't afford it, when enough will have drained, and
    the least any window has left now of each unit (None: no limit of that unit)."""

    ok: bool
    used_tokens: tuple[int, ...] = ()
    window: int = -1
    unit: Unit = Unit.TOKENS
    retry_ms: int = 0
    unseeded: bool = False  # Redis lost the bucket: rebuild it from the ledger, then retry
    left_tokens: int | None = None
    left_cost: int | None = None


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class WindowUsage:
    window: Rolling
    tokens: int  # committed in the window
    cost: int
    requests: int = 0


# Made per request: not frozen (see LimitState, spendguard/store/base.py).
@dataclass(slots=True, unsafe_hash=True)
class BucketUsage:
    bucket: Bucket
    held_tokens: int  # live holds (in every window)
    held_cost: int
    windows: tuple[WindowUsage, ...]
    held_requests: int = 0  # one per live hold


# A threshold of one amount of a budget limit: unit ("t" tokens, "c" micro-USD, "r" requests),
# percent, the amount, and the usage at which it fires (rounded up).
Mark = tuple[str, int, int, int]

# What the ledger says a window's slice counted: slice index, tokens, cost, requests.
SeedSlice = tuple[int, int, int, int]


@lru_cache(maxsize=1024)
def limit_marks(limit: BudgetLimit) -> tuple[Mark, ...]:
    """What ``limit``'s alert thresholds fire at, per amount it has (made once per limit)."""
    out: list[Mark] = []
    for pct in limit.alert_at:
        for unit, amount in (("t", limit.tokens), ("c", limit.cost_micros), ("r", limit.requests)):
            if amount:
                out.append((unit, pct, amount, -(-amount * pct // 100)))
    return tuple(out)


def bucket_marks(call: BucketCheck) -> tuple[str | None, ...] | None:
    """The commit script's thresholds of each window of ``call`` (``"t80:1000:800 ..."``, None
    for a window without any), or None when no window has any."""
    specs = tuple(
        " ".join(f"{u}{p}:{a}:{at}" for u, p, a, at in limit_marks(c.limit)) or None
        for c in call.checks
    )
    return specs if any(specs) else None


def retry_ms(
    slices: dict[int, int],
    window: Rolling,
    now_ms: int,
    used: int,
    wanted: int,
    limit: int,
) -> int:
    """Milliseconds until enough of the window's slices (index -> amount) have left it for
    ``wanted`` to fit under ``limit``. Mirrors reserve.lua.

    A request larger than the limit itself never fits: the whole period is answered. When the
    committed slices are not enough (live holds of requests in flight fill the rest) it is the
    time until all of them have left, or a second when there are none: holds end with their
    requests, typically within seconds, and nothing says when. A calendar window's usage all
    leaves at its reset: until then.
    """
    if window.calendar is not None:
        return max(1, window.reset_ms(now_ms) - now_ms)
    slice_ms = window.slice_ms
    if wanted > limit:
        return window.period_ms
    need = used + wanted - limit
    cur = now_ms // slice_ms
    drained = 0
    last = 0
    for idx in range(cur - SLICES + 1, cur + 1):
        amount = slices.get(idx, 0)
        if amount <= 0:
            continue
        drained += amount
        last = (idx + SLICES) * slice_ms - now_ms
        if drained >= need:
            return max(last, 1)
    return max(last, 1000)
