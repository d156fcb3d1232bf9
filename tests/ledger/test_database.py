"""Tests for spendguard.ledger.database: connecting, the schema, an unreachable server."""

from __future__ import annotations

import pytest

from spendguard.errors import LedgerUnavailable
from spendguard.ledger import Ledger

pytestmark = pytest.mark.anyio


async def test_schema_init_is_idempotent(ledger: Ledger) -> None:
    await ledger.init_schema()
    await ledger.init_schema()
    assert await ledger.list_policies() == []


async def test_unreachable_database_raises_ledger_unavailable() -> None:
    led = Ledger("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(LedgerUnavailable):
        await led.connect()
