"""Prometheus metrics, with closed label sets. Defined once per process.

Served by whatever exposes your app's default registry (e.g. ``prometheus_client``'s
``make_asgi_app()`` mounted at ``/metrics``).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
DEFAULT_PRICED = Counter(
    "spendguard_default_priced_total",
    "Costs computed at the price table's 'default' entry, for models the table does not price "
    "(stage: estimate = postflight's estimate, settlement = the exact charge).",
    ["stage"],
)
