"""Threshold alerts: a limit's usage reaching a percentage of it, told once, off the request
path (docs/alerts.md).

The store fires an alert in the same atomic step that counts the usage (the postflight), once
per limit amount, window and threshold across every replica; the gateway moves it into the
ledger's outbox (:mod:`spendguard.ledger.alerts`), and :class:`AlertService` delivers what the
outbox holds: a log line and a metric always, and a signed webhook (JSON or Slack-compatible)
when one is configured, retried with backoff until the receiver takes it.
"""

from __future__ import annotations

from .events import Alert, parse_pending
from .service import AlertService
from .signing import SIGNATURE_HEADER, sign, verify
from .thresholds import marks_for, parse_thresholds

__all__ = [
    "SIGNATURE_HEADER",
    "Alert",
    "AlertService",
    "marks_for",
    "parse_pending",
    "parse_thresholds",
    "sign",
    "verify",
]
