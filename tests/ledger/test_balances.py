"""Tests for spendguard.ledger.balances: prepaid accounts, topped up and debited by settlement."""

from __future__ import annotations

import pytest

from spendguard.ledger import Account, Ledger
from tests.ledger.helpers import OCT1
from tests.support import make_record, topups_total, unit_price

pytestmark = pytest.mark.anyio


async def test_settlement_debits_balances_in_the_same_transaction(ledger: Ledger) -> None:
    assert await ledger.load_balance("acme") is None
    opened = await ledger.topup(team="acme", team_id="acme", micros=1_000)
    assert opened == Account("acme", 1_000, 0) and opened.balance == 1_000
    assert await ledger.load_limits("acme") == ([], opened)  # an account, no policy
    await ledger.insert_records(
        [
            make_record("a", OCT1, 7),
            make_record("b", OCT1, 8),
            make_record("c", OCT1, 9, team="other"),
        ]
    )
    await ledger.settle(100, unit_price, now=OCT1)
    assert await ledger.load_balance("acme") == Account("acme", 1_000, 15)
    assert await ledger.load_balance("other") is None  # no account: not debited, not created
    account = await ledger.topup(team="acme", team_id="acme", micros=500)
    assert account == Account("acme", 1_500, 15) and account.balance == 1_485
    assert await ledger.balance_accounts() == {"acme": account}
    assert await topups_total(ledger.url, "acme") == 1_500
    with pytest.raises(ValueError):
        await ledger.topup(team="acme", team_id="acme", micros=0)
