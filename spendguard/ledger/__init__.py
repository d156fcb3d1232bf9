"""The SQL ledger: every query spendguard runs, on SQLite or PostgreSQL.

:class:`Ledger` is one object over one database, put together from a module per job:
:mod:`.database` (connection, errors, locks, schema), :mod:`.policies` (limits and their
aggregates), :mod:`.balances` (prepaid accounts), :mod:`.records` (inference records),
:mod:`.settlement` (charging records), :mod:`.journal` (what each settlement settled, for the
cache sync), :mod:`.reports` (CLI reports) and :mod:`.alerts` (the alerts outbox). Callers pass
and get typed values (:class:`~spendguard.limits.Limit`, :class:`~spendguard.limits.Policy`,
...) and see :class:`~spendguard.errors.LedgerUnavailable` for any database failure.
"""

from __future__ import annotations

from .alerts import AlertQueries
from .balances import Account
from .budgets import BudgetOverride, BudgetQueries, UsedSlice
from .denials import DenialQueries, DenialRow
from .journal import JournalQueries, SettledRecord
from .policies import Aggregate, PolicyQueries
from .records import RecordQueries
from .reports import ReportQueries, SpendRow, TopRow
from .settlement import RecordRow, Settlement, SettlementQueries


class Ledger(
    PolicyQueries,
    AlertQueries,
    DenialQueries,
    RecordQueries,
    SettlementQueries,
    JournalQueries,
    ReportQueries,
    BudgetQueries,
):
    """The ledger of one database URL (``sqlite:///...`` or ``postgresql://...``)."""


__all__ = [
    "Account",
    "Aggregate",
    "BudgetOverride",
    "DenialRow",
    "Ledger",
    "RecordRow",
    "SettledRecord",
    "Settlement",
    "SpendRow",
    "TopRow",
    "UsedSlice",
]
