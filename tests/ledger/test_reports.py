"""Tests for spendguard.ledger.reports: spend per key and team and window."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.identity import Identity
from spendguard.ledger import Ledger, SpendRow
from spendguard.limits import Limit, Period, Subject
from tests.ledger.helpers import ACME, ALPHA, OCT1, SEP30_LATE
from tests.support import make_record, unit_price

pytestmark = pytest.mark.anyio


async def test_spend_reports_keys_and_team_per_window(ledger: Ledger) -> None:
    assert await ledger.spend("acme", OCT1) == [
        SpendRow(Limit(ACME, Period.DAY), None, "20261001", 0),
        SpendRow(Limit(ACME, Period.MONTH), None, "202610", 0),
    ]
    await ledger.insert_records(
        [
            make_record("late", SEP30_LATE, 7),  # September only
            make_record("a", OCT1, 11),
            make_record("b", OCT1, 5, key="b\u00e9ta"),  # raw id differs from the encoded one
            make_record("c", OCT1, 2, key=None),
            make_record("x", OCT1, 100, team="other"),
        ]
    )
    await ledger.settle(100, unit_price, now=OCT1)
    beta = Identity("acme", "b\u00e9ta").api_key
    assert beta is not None and beta != "b\u00e9ta"
    rows = await ledger.spend("acme", datetime(2026, 10, 20, tzinfo=UTC))
    assert rows == [
        SpendRow(Limit(ACME, Period.DAY), None, "20261020", 0),
        SpendRow(Limit(ALPHA, Period.MONTH), "alpha", "202610", 11),
        SpendRow(Limit(Subject("acme", beta), Period.MONTH), "b\u00e9ta", "202610", 5),
        SpendRow(Limit(ACME, Period.MONTH), None, "202610", 18),
    ]
    sep = await ledger.spend("acme", SEP30_LATE)
    assert sep == [
        SpendRow(Limit(ALPHA, Period.DAY), "alpha", "20260930", 7),
        SpendRow(Limit(ACME, Period.DAY), None, "20260930", 7),
        SpendRow(Limit(ALPHA, Period.MONTH), "alpha", "202609", 7),
        SpendRow(Limit(ACME, Period.MONTH), None, "202609", 7),
    ]
