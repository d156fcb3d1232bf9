"""Prometheus metrics, with closed label sets (R10.3). Defined once per process.

Served by whatever exposes your app's default registry (e.g. ``prometheus_client``'s
``make_asgi_app()`` mounted at ``/metrics``).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
