"""JSON views of what the admin API returns, shared by the CLI's ``--json`` output and the
admin HTTP routes so the two never drift: each view is defined here once, and for the same data
``spendguard ... --json`` prints the structure the matching route answers (docs/admin-http.md
has every shape).

One vocabulary for both: money as integer micro-USD (``*_micros``) next to an exact decimal
string (``*_usd``); a limit's usage is ``used_micros`` (the cache's settled plus pending when
readable, else the settled spend) and what is left of it ``remaining_micros``; times are RFC
3339 in UTC ending in ``Z`` (``2026-12-02T00:00:00Z``); an API key is its raw id, with the
team's own entry under ``"api_key": null`` (model lists, keyed by encoded id, use ``""``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..clock import time_text
from ..limits import Policy
from ..limits.rates import Rates
from ..money import usd_text
from .admin import BalanceReport, LimitUsage, TopReport, UsageReport

if TYPE_CHECKING:
    from ..alerts.events import Alert
    from ..budgets.admin import BudgetReport
    from ..ledger import Account, BudgetOverride
    from .forecast import Forecast

RATE_FIELDS = ("rpm", "tpm", "max_parallel")


# -- policies --------------------------------------------------------------------------------
def policy_json(policy: Policy) -> dict[str, Any]:
    return {
        "team": policy.team_id,
        "api_key": policy.api_key_id,
        "period": policy.limit.window.value,
        "limit_micros": policy.amount,
        "limit_usd": usd_text(policy.amount),
        "mode": "hard" if policy.hard else "soft",
        "fit": policy.fit,  # hard: fitted to what is left instead of refused
        # Percentages that alert once per window; null: the gateway's default thresholds.
        "alert_at": None if policy.alert_at is None else list(policy.alert_at),
    }


def policies_json(policies: Iterable[Policy], team_id: str | None = None) -> dict[str, Any]:
    """Active policies: of one team (``"team"`` named) or of every team (no ``"team"``)."""
    listed = [policy_json(p) for p in policies]
    return {"policies": listed} if team_id is None else {"team": team_id, "policies": listed}


def removed_json(removed: bool) -> dict[str, Any]:
    return {"removed": removed}


# -- usage -----------------------------------------------------------------------------------
def limit_usage_json(row: LimitUsage) -> dict[str, Any]:
    """One subject's spend in one current period, with its limit if it has one."""
    return {
        "scope": row.limit.subject.kind.value,
        "api_key": row.api_key_id,
        "period": row.limit.window.value,
        "period_id": row.bucket,
        "settled_micros": row.settled,
        "settled_usd": usd_text(row.settled),
        "used_micros": row.used,
        "used_usd": usd_text(row.used),
        "limit_micros": row.amount,
        "limit_usd": usd_text(row.amount),
        "remaining_micros": row.remaining,
        "remaining_usd": usd_text(row.remaining),
        "resets_at": time_text(row.resets_at),
        # The shared cache's view (None when not readable here): what settlement folded in,
        # estimates of finished inferences still pending, holds of running ones on a hard limit.
        "cache": None
        if row.parts is None
        else {
            "settled_micros": row.parts.settled,
            "pending_micros": row.parts.pending,
            "held_micros": row.parts.held,
        },
        "forecast": None if row.forecast is None else forecast_json(row.forecast),
    }


def forecast_json(f: Forecast) -> dict[str, Any]:
    """Where a limit is heading at its recent spend rate (engine/forecast.py)."""
    return {
        "last_hour_micros": f.last_hour,
        "last_day_micros": f.last_day,
        "rate_per_hour_micros": f.rate_per_hour,
        "rate_per_hour_usd": usd_text(f.rate_per_hour),
        "projected_micros": f.projected,
        "projected_usd": usd_text(f.projected),
        "runs_out_at": None if f.runs_out_at is None else time_text(f.runs_out_at),
    }


def usage_json(report: UsageReport, api_key_id: str | None = None) -> dict[str, Any]:
    """A team's usage (``api_key_id``: asked for that key's rows and the team's only)."""
    return {
        "team": report.team_id,
        "api_key": api_key_id,
        "at": time_text(report.at),
        "limits": [limit_usage_json(row) for row in report.limits],
        "charges_total_micros": report.charges_total,
        "charges_total_usd": usd_text(report.charges_total),
        "unsettled_records": report.unsettled_records,
        "unsettled_estimate_micros": report.unsettled_estimate,
        "unsettled_estimate_usd": usd_text(report.unsettled_estimate),
        "cache_error": report.cache_error,
    }


# -- balances --------------------------------------------------------------------------------
def balance_json(team_id: str, account: Account) -> dict[str, Any]:
    """A prepaid account: what a top-up or a mode change answers."""
    return {
        "team": team_id,
        "mode": "hard" if account.hard else "soft",
        "topped_up_micros": account.topped_up,
        "topped_up_usd": usd_text(account.topped_up),
        "charged_micros": account.charged,
        "charged_usd": usd_text(account.charged),
        "balance_micros": account.balance,
        "balance_usd": usd_text(account.balance),
    }


def balance_report_json(report: BalanceReport) -> dict[str, Any]:
    """A prepaid account with what is left of it and what is not settled yet."""
    return balance_json(report.team_id, report.account) | {
        "remaining_micros": report.remaining,
        "remaining_usd": usd_text(report.remaining),
        "unsettled_records": report.unsettled_records,
        "unsettled_estimate_micros": report.unsettled_estimate,
        "unsettled_estimate_usd": usd_text(report.unsettled_estimate),
    }


# -- model lists and rates -------------------------------------------------------------------
def model_lists_json(team_id: str, lists: Mapping[str | None, list[str]]) -> dict[str, Any]:
    """A team's model lists, keyed by the encoded API key id ("" is the team's own list)."""
    return {"team": team_id, "lists": {key or "": pats for key, pats in lists.items()}}


def rate_values(value: Rates) -> dict[str, int | None]:
    """A subject's rates by name (None: not limited)."""
    return {name: getattr(value, name) for name in RATE_FIELDS}


def rates_json(team_id: str, rates: Mapping[str | None, Rates]) -> dict[str, Any]:
    """A team's rates, the team's own first (``"api_key": null``), then its keys' by id."""
    ordered = sorted(rates.items(), key=lambda kv: (kv[0] is not None, kv[0] or ""))
    return {
        "team": team_id,
        "rates": [{"api_key": key, **rate_values(value)} for key, value in ordered],
    }


# -- budgets ---------------------------------------------------------------------------------
def budget_report_json(report: BudgetReport) -> dict[str, Any]:
    """The effective budgets config and every scope x window's counters."""
    return report.as_json()


def budget_reset_json(buckets: int) -> dict[str, Any]:
    return {"reset": buckets}


def key_budget_json(override: BudgetOverride) -> dict[str, Any]:
    """A key's own token budget."""
    return {
        "team": override.team_id,
        "api_key": override.api_key_id,
        "max_tokens_budget": override.max_tokens,
        "budget_window": override.budget_window,
    }


# -- who is spending ------------------------------------------------------------------------
def top_json(report: TopReport) -> dict[str, Any]:
    """The top spenders of the current period, biggest first."""
    rows = []
    for s in report.spenders:
        r = s.row
        entry: dict[str, Any]
        if report.by == "model":
            entry = {"model": r.model}
        elif report.by == "tag":
            entry = {"tag": r.name}
        elif report.by == "customer":
            entry = {"customer": r.name}
        elif report.by == "end_user":
            entry = {"team": r.team_id, "end_user": r.name}
        else:
            entry = {"team": r.team_id, "api_key": r.api_key_id if r.api_key else None}
        entry |= {
            "spent_micros": r.spent,
            "spent_usd": usd_text(r.spent),
            "requests": r.requests,
        }
        if report.by in ("team", "key"):
            entry |= {
                "limit_micros": s.amount,
                "limit_usd": usd_text(s.amount),
                "remaining_micros": s.remaining,
                "remaining_usd": usd_text(s.remaining),
                "resets_at": time_text(s.resets_at),
                "forecast": None if s.forecast is None else forecast_json(s.forecast),
                "denied_last_hour": s.denied_last_hour,
            }
        rows.append(entry)
    return {
        "by": report.by,
        "period": report.period.value,
        "period_id": report.period_id,
        "at": time_text(report.at),
        "spenders": rows,
    }


# -- alerts ----------------------------------------------------------------------------------
def alert_test_json(sent: Alert, error: str | None) -> dict[str, Any]:
    """What ``alerts test`` (and ``POST /alerts/test``) sent, and whether it was taken."""
    return {"sent": sent.as_json(), "delivered": error is None, "error": error}


def alerts_json(rows: Iterable[tuple[Alert, datetime | None, int]]) -> dict[str, Any]:
    """The newest alerts, each as its webhook carries it plus where its delivery stands."""
    out = []
    for alert, delivered, attempts in rows:
        entry = alert.as_json()
        entry["delivered_at"] = None if delivered is None else time_text(delivered)
        entry["attempts"] = attempts
        out.append(entry)
    return {"alerts": out}
