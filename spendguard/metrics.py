"""Prometheus metrics, with closed label sets. Defined once per process.

Served by whatever exposes your app's default registry (e.g. ``prometheus_client``'s
``make_asgi_app()`` mounted at ``/metrics``).
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

from .hotmetrics import HotCounter, HotHistogram
from .hotmetrics import register as register_hot_metrics

STORE_UNAVAILABLE = Counter(
    "spendguard_store_unavailable_total",
    "Requests that found the store unavailable, by what spendguard did.",
    ["action"],  # allow (fail open) | deny (fail closed or tracker full)
)
FAIL_OPEN_TRACKED = Gauge(
    "spendguard_fail_open_tracked_identities",
    "Identities counted by the local fail-open tracker during a store outage.",
)
RECORDS_DROPPED = Counter(
    "spendguard_records_dropped_total",
    "Inference records dropped because the record buffer was full.",
)
AGGREGATE_UPDATE_SECONDS = Histogram(
    "spendguard_aggregate_update_seconds",
    "Time of a settlement batch's aggregate update (one statement for all its rows); on "
    "PostgreSQL it includes row-lock waits on hot team-month rows.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
SETTLED_RECORDS = Counter("spendguard_settled_records_total", "Records settled by this process.")
ESTIMATE_ERROR = Counter(
    "spendguard_estimate_error_micros_total",
    "Sum of (exact charge - postflight estimate) over settled records, by sign.",
    ["sign"],
)
STALE_POLICY_FILLS = Counter(
    "spendguard_stale_policy_fills_total",
    "Policy cache fills from the last policies read, because the ledger could not be read.",
)
CACHE_REFRESH_FAILURES = Counter(
    "spendguard_cache_refresh_failures_total", "Cache refreshes that failed after a commit."
)
RECOVERED_RECORDS = Counter(
    "spendguard_recovered_records_total",
    "Records written from the admission entries of a gateway that died (kind: closed = its "
    "whole record, open = its admission estimate).",
    ["kind"],
)
UNKNOWN_MODEL = Counter(
    "spendguard_unknown_model_total",
    "Prices asked for a model the price table does not know, by the unknown-model rule that "
    "answered (default_price, free, reject) and the stage (admission, hold, estimate, "
    "settlement).",
    ["rule", "stage"],
)
DEFAULT_PRICED = Counter(
    "spendguard_default_priced_total",
    "Costs computed at the price table's 'default' entry, for models the table does not price "
    "(stage: estimate = postflight's estimate, settlement = the charge of a record without a "
    "price of its own, hold = preflight's worst case held on hard limits, not a charge).",
    ["stage"],
)

# -- the request path -------------------------------------------------------------------------
# Every label value below is from a fixed set written in this module (docs/metrics.md lists
# them); never a team, key, model or route. The request path uses pre-bound children
# (``.labels()`` resolved here, once) of lock-free counters and histograms (``hotmetrics``):
# a request costs a few plain ``inc``/``observe`` calls, about 0.1 µs each. Under
# prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set) they are its own
# counters and histograms instead, which that mode aggregates across processes.
_LEGACY_MULTIPROC = "prometheus_multiproc_dir"  # the deprecated spelling, still honoured
_MULTIPROCESS = bool(
    os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(_LEGACY_MULTIPROC)
)
_Counter = Counter if _MULTIPROCESS else HotCounter
_Histogram = Histogram if _MULTIPROCESS else HotHistogram

DECISIONS = _Counter(
    "spendguard_decisions_total",
    "Admission decisions, by outcome (allowed, denied, error), what decided (kind) and the "
    "deciding limit's period.",
    ["outcome", "kind", "period"],
)
STORE_SECONDS = _Histogram(
    "spendguard_store_seconds",
    "Store calls as the engine awaits them (queueing in a pipelined batch included), by call: "
    "preflight (one per round; a cache miss adds a round), postflight, release (an admitted "
    "inference that is not charged).",
    ["call"],
    buckets=(
        0.00005,
        0.0001,
        0.00025,
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
    ),
)
SPEND = _Counter(
    "spendguard_spend_micros_total",
    "Micro-USD charged by postflight (its estimate at the price table; settlement's exact "
    "charge differs by spendguard_estimate_error_micros_total).",
)
TOKENS = _Counter(
    "spendguard_tokens_total",
    "Tokens of charged inferences, by type (input excludes cache reads and writes).",
    ["type"],  # input | output | cached_input | cache_write
)
RECORDS_WRITTEN = Counter(
    "spendguard_records_written_total", "Inference records written to the ledger."
)
RECORDS_PENDING = Gauge(
    "spendguard_records_pending",
    "Inference records accepted but not yet written to the ledger (every guard of the process).",
    multiprocess_mode="livesum",
)
OVERSPEND = Counter(
    "spendguard_overspend_micros_total",
    "Micro-USD that settlement found beyond a limit: the part of each settled batch's charges "
    "that took a limit's settled total over its amount (or a prepaid balance below zero), by "
    "the limit's kind and period.",
    ["kind", "period"],  # team | api_key with day | month; balance with none
)
UNLISTED_INFERENCE = Counter(
    "spendguard_unlisted_inference_total",
    "Requests whose JSON body looks like an inference on a route that is neither a guarded "
    "route nor a pass route, by what spendguard did: refused (403), passed (the app served it "
    "unlimited and unrecorded), uninspected (a body beyond SPENDGUARD_MAX_BODY_BYTES, passed "
    "unread).",
    ["action"],  # refused | passed | uninspected
)
UNLISTED_BY_ACTION = {
    action: UNLISTED_INFERENCE.labels(action) for action in ("refused", "passed", "uninspected")
}

# The closed label values (docs/metrics.md). Periods come from the window enum; a new limit
# kind (e.g. "rate") adds its members here.
ALLOWED, DENIED, ERROR = "allowed", "denied", "error"
NO_PERIOD = "none"
ALLOWED_KINDS = ("limited", "unlimited", "fail_open", "unidentified")
LIMIT_KINDS = ("team", "api_key")
DENIED_KINDS = ("balance", "model", "rate", "unpriced", "identity", "other")
ERROR_KINDS = ("store", "store_full", "ledger", "vanished")
TOKEN_TYPES = ("input", "output", "cached_input", "cache_write")
STORE_CALLS = ("preflight", "postflight", "release")


def _periods() -> tuple[str, ...]:
    from .limits.windows import Period  # no engine import: the engine imports this module

    return tuple(p.value for p in Period)


PERIODS = _periods()
# Pre-bound children: every series exists (at 0) from the start, so rate() sees the first one.
ALLOWED_BY_KIND = {kind: DECISIONS.labels(ALLOWED, kind, NO_PERIOD) for kind in ALLOWED_KINDS}
DENIED_BY_LIMIT = {
    (kind, period): DECISIONS.labels(DENIED, kind, period)
    for kind in LIMIT_KINDS
    for period in PERIODS
}
DENIED_BY_KIND = {kind: DECISIONS.labels(DENIED, kind, NO_PERIOD) for kind in DENIED_KINDS}
ERROR_BY_KIND = {kind: DECISIONS.labels(ERROR, kind, NO_PERIOD) for kind in ERROR_KINDS}
TOKENS_BY_TYPE = tuple(TOKENS.labels(t) for t in TOKEN_TYPES)
PREFLIGHT_SECONDS = STORE_SECONDS.labels("preflight")
POSTFLIGHT_SECONDS = STORE_SECONDS.labels("postflight")
RELEASE_SECONDS = STORE_SECONDS.labels("release")
OVERSPEND_BY_LIMIT = {
    (kind, period): OVERSPEND.labels(kind, period) for kind in LIMIT_KINDS for period in PERIODS
}
OVERSPEND_BY_LIMIT["balance", NO_PERIOD] = OVERSPEND.labels("balance", NO_PERIOD)

_recorders: weakref.WeakSet[_Pending] = weakref.WeakSet()


class _Pending(Protocol):
    @property
    def pending(self) -> int: ...


def track_pending(recorder: _Pending) -> None:
    """Count ``recorder``'s pending records in spendguard_records_pending while it lives (read
    at scrape time: nothing on the request path)."""
    _recorders.add(recorder)


def _pending() -> float:
    return float(sum(r.pending for r in list(_recorders)))


def pending_changed() -> None:
    """The record writer's note after each write attempt. Multiprocess mode reads gauges from
    files, not functions: there the value is stored now; otherwise a scrape reads it."""
    if _MULTIPROCESS:
        RECORDS_PENDING.set(_pending())


if not _MULTIPROCESS:
    RECORDS_PENDING.set_function(_pending)
# Budgets (window ids are the operator's, from a closed file; never a model or a key id).
BUDGET_USED = _Counter(
    "spendguard_budget_used_total",
    "Usage recorded against budgets (tokens, or cost in micro-USD).",
    ["scope", "window", "unit"],
)
FITTED = Counter(
    "spendguard_fitted_total",
    "Requests admitted with their output cap lowered to what a limit had left (each also "
    "counted once as a denial in spendguard_decisions_total: its first ask).",
)
BUDGET_REJECTIONS = Counter(
    "spendguard_budget_rejections_total",
    "Requests a budget scope denied.",
    ["scope", "window"],
)
BUDGET_STORE_UNAVAILABLE = Counter(
    "spendguard_budget_storage_unavailable_total",
    "Budget checks that found Redis unavailable: fallback (fail open, counted locally) or "
    "refused (fail closed, 503).",
    ["action"],
)

register_hot_metrics()
ALERTS = Counter(
    "spendguard_alerts_total",
    "Threshold alerts this process put into the ledger's outbox (each alert once, by kind).",
    ["kind"],  # threshold | projected
)
ALERT_DELIVERIES = Counter(
    "spendguard_alert_deliveries_total",
    "Alert deliveries by result: delivered (a webhook took it), logged (no webhook: the log "
    "line is its delivery), failed (an attempt failed; it is retried).",
    ["result"],
)

# Every closed label set of the counters above, exported at 0 from start-up: a dashboard's
# first increase() counts the first event, and no panel reads "No data". (The budgets' series
# carry the operator's window ids; they start when the budgets section is read.)
PRICE_RULES = ("default_price", "free", "reject")  # UnknownModel's values
PRICE_STAGES = ("estimate", "settlement", "hold", "admission")  # costing.Stage's values
CLOSED_LABELS: dict[Counter, tuple[tuple[str, ...], ...]] = {
    STORE_UNAVAILABLE: (("allow",), ("deny",)),
    ESTIMATE_ERROR: (("over",), ("under",)),
    RECOVERED_RECORDS: (("open",), ("closed",)),
    UNKNOWN_MODEL: tuple((rule, stage) for rule in PRICE_RULES for stage in PRICE_STAGES),
    DEFAULT_PRICED: tuple((stage,) for stage in PRICE_STAGES),
    BUDGET_STORE_UNAVAILABLE: (("fallback",), ("refused",)),
    ALERTS: (("threshold",), ("projected",)),
    ALERT_DELIVERIES: (("delivered",), ("logged",), ("failed",)),
}
for _counter, _label_sets in CLOSED_LABELS.items():
    for _values in _label_sets:
        _counter.labels(*_values)
