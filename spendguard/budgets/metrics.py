"""Budget metrics. Labels are closed: scope and unit are fixed sets, window ids come from the
operator's file; never a model name or a key id."""

from __future__ import annotations

from prometheus_client import Counter

REJECTIONS = Counter(
    "spendguard_budget_rejections_total",
    "Requests a budget scope denied.",
    ["scope", "window"],
)
USED = Counter(
    "spendguard_budget_used",
    "Usage recorded against budgets (tokens, or cost in micro-USD).",
    ["scope", "window", "unit"],
)
STORAGE_UNAVAILABLE = Counter(
    "spendguard_budget_storage_unavailable_total",
    "Budget checks that found Redis unavailable: fallback (fail open, counted locally) or "
    "refused (fail closed, 503).",
    ["action"],
)
