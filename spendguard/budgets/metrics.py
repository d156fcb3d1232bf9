"""Budget metrics. Labels are closed: scope and unit are fixed sets, window ids come from the
operator's file; never a model name or a key id."""

from __future__ import annotations

from prometheus_client import Counter

from ..metrics import BUDGET_USED

REJECTIONS = Counter(
    "spendguard_budget_rejections_total",
    "Requests a budget scope denied.",
    ["scope", "window"],
)
# On the request path: one of the lock-free counters (spendguard/metrics.py).
USED = BUDGET_USED
STORAGE_UNAVAILABLE = Counter(
    "spendguard_budget_storage_unavailable_total",
    "Budget checks that found Redis unavailable: fallback (fail open, counted locally) or "
    "refused (fail closed, 503).",
    ["action"],
)
