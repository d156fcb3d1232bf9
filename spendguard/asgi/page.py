"""The spend page: one server-rendered HTML page of the admin app (``GET /page``), for a person
rather than a script: every team's limits as bars against their amounts, when each resets and
where it is heading, today's top spenders and the newest alerts. No script, no external
stylesheet or font: everything it shows is in the one response, which refreshes itself.

A browser can't send the admin token as a header, so ``/page`` asks for it once in a form
(``POST /page/login``) and keeps a cookie derived from it (an HMAC of the token, HttpOnly,
SameSite=Strict): the cookie opens this page only, never the JSON routes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from datetime import datetime
from html import escape

from ..alerts.events import Alert
from ..clock import time_text
from ..engine.admin import LimitUsage, TopReport, UsageReport
from ..ledger import DenialRow
from ..money import usd_text

COOKIE = "spendguard_page"
REFRESH_SECONDS = 30

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2430;background:#f7f8fa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
.muted{color:#667085}table{border-collapse:collapse;width:100%;background:#fff}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #e4e7ec;vertical-align:middle}
th{font-weight:600;color:#475467;background:#f2f4f7}
.bar{width:220px;height:12px;background:#e4e7ec;border-radius:6px;overflow:hidden}
.fill{height:100%;background:#12b76a}.warn .fill{background:#f79009}.over .fill{background:#f04438}
.num{font-variant-numeric:tabular-nums;white-space:nowrap}
form{background:#fff;padding:16px;max-width:420px;border:1px solid #e4e7ec}
input{font:inherit;padding:6px;width:100%;box-sizing:border-box;margin:8px 0}
"""


def cookie_value(token: str) -> str:
    """What the page's cookie holds: derived from the token, useless as a token itself."""
    return hmac.new(token.encode(), b"spendguard spend page", hashlib.sha256).hexdigest()


def cookie_matches(cookie: str | None, token: str) -> bool:
    return cookie is not None and hmac.compare_digest(cookie, cookie_value(token))


def _doc(title: str, body: str, *, refresh: bool = False) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if refresh else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"{meta}<title>{escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


def login_page(root: str, wrong: bool = False) -> str:
    """The sign-in form (``root``: where the admin app is mounted)."""
    note = '<p class="muted" id="wrong">Wrong token.</p>' if wrong else ""
    return _doc(
        "spendguard: sign in",
        "<h1>spendguard</h1>"
        f'<form method="post" action="{escape(root)}/page/login">'
        "<label for=token>Admin token (SPENDGUARD_ADMIN_TOKEN)</label>"
        "<input id=token name=token type=password autocomplete=current-password autofocus>"
        f'<button type="submit">Open the spend page</button>{note}</form>',
    )


def _when(at: datetime) -> str:
    return escape(time_text(at.replace(microsecond=0)))


def _usd(micros: int | None) -> str:
    return "—" if micros is None else f"${usd_text(micros)}"


def _bar(used: int, amount: int | None) -> str:
    if amount is None:
        return '<span class="muted">no limit</span>'
    share = 100.0 if amount == 0 else min(100.0, 100.0 * used / amount)
    level = "over" if share >= 100 else "warn" if share >= 80 else ""
    return (
        f'<div class="bar {level}" role="meter" aria-valuenow="{share:.0f}" '
        f'aria-valuemin="0" aria-valuemax="100" title="{share:.0f}%">'
        f'<div class="fill" style="width:{share:.1f}%"></div></div>'
    )


def _limit_row(team_id: str, row: LimitUsage) -> str:
    who = escape(team_id) + (
        f" / {escape(row.api_key_id)}"
        if row.limit.subject.api_key is not None and row.api_key_id
        else ""
    )
    f = row.forecast
    heading = "—"
    if f is not None and f.rate_per_hour:
        heading = f"{_usd(f.rate_per_hour)}/h, {_usd(f.projected)} at reset"
        if row.amount is not None and row.used >= row.amount:
            heading += ", <b>limit reached</b>"
        elif f.runs_out_at is not None:
            heading += f", <b>runs out {_when(f.runs_out_at)}</b>"
    share = "" if row.amount is None else f" ({_share(row.used, row.amount)})"
    return (
        f"<tr><td>{who}</td><td>{escape(row.limit.window.value)}</td>"
        f"<td>{_bar(row.used, row.amount)}</td>"
        f'<td class="num">{_usd(row.used)} of {_usd(row.amount)}{share}</td>'
        f'<td class="num">{_usd(row.remaining)}</td>'
        f'<td class="num">{_when(row.resets_at)}</td><td>{heading}</td></tr>'
    )


def _share(used: int, amount: int) -> str:
    return "100%+" if amount == 0 or used >= amount else f"{100 * used // amount}%"


def spend_page(
    at: datetime,
    reports: Sequence[UsageReport],
    top: TopReport,
    alerts: Iterable[tuple[Alert, datetime | None, int]],
    denials: Iterable[DenialRow] = (),
) -> str:
    limits = [
        _limit_row(report.team_id, row)
        for report in reports
        for row in report.limits
        if row.amount is not None
    ]
    teams = (
        "<table id=limits><tr><th>team / key</th><th>window</th><th>used</th><th></th>"
        "<th>left</th><th>resets</th><th>at the recent rate</th></tr>"
        + "".join(limits)
        + "</table>"
        if limits
        else '<p class="muted">No limits set yet.</p>'
    )
    spenders = "".join(
        f"<tr><td>{escape(s.row.team_id)}"
        + (f" / {escape(s.row.api_key_id or s.row.api_key)}" if s.row.api_key else "")
        + f'</td><td class="num">{_usd(s.row.spent)}</td><td class="num">{s.row.requests}</td>'
        f'<td class="num">{s.denied_last_hour}</td><td>{_bar(s.row.spent, s.amount)}</td></tr>'
        for s in top.spenders
    )
    top_html = (
        "<table id=top><tr><th>team / key</th><th>spent</th><th>requests</th>"
        f"<th>refused (last hour)</th><th>of its limit</th></tr>{spenders}</table>"
        if spenders
        else '<p class="muted">No spend today.</p>'
    )
    alert_rows = "".join(
        f"<tr><td class=num>{_when(a.fired_at)}</td>"
        f"<td>{escape(a.text.removeprefix('spendguard: '))}</td>"
        f"<td>{'delivered' if done else f'pending ({attempts} attempts)'}</td></tr>"
        for a, done, attempts in alerts
    )
    alerts_html = (
        f"<table id=alerts><tr><th>fired</th><th>alert</th><th>delivery</th></tr>{alert_rows}"
        "</table>"
        if alert_rows
        else '<p class="muted">No alerts.</p>'
    )
    denial_rows = "".join(
        f"<tr><td class=num>{_when(d.at)}</td><td>{escape(d.team_id)}"
        + (f" / {escape(d.api_key_id)}" if d.api_key_id else "")
        + f"</td><td>{escape(d.kind)}</td><td>{escape(d.model)}</td></tr>"
        for d in denials
    )
    denials_html = (
        "<table id=denials><tr><th>when</th><th>team / key</th><th>refused by</th>"
        f"<th>model</th></tr>{denial_rows}</table>"
        if denial_rows
        else '<p class="muted">No denials this week.</p>'
    )
    body = (
        "<h1>spendguard: spend</h1>"
        f'<p class="muted">As of {_when(at)}; this page refreshes every '
        f"{REFRESH_SECONDS} s.</p>"
        f"<h2>Limits</h2>{teams}"
        f"<h2>Top spenders today ({escape(top.period_id)})</h2>{top_html}"
        f"<h2>Recent denials</h2>{denials_html}"
        f"<h2>Recent alerts</h2>{alerts_html}"
    )
    return _doc("spendguard: spend", body, refresh=True)
