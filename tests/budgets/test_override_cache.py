"""The caches that keep SQL off the request path for budgets (a key's override, a customer's
top-ups): a change made here while a read of the old value is in flight is not undone by that
read when it lands."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from spendguard.engine.overrides import CustomerBalances, OverrideCache
from spendguard.identity import Identity
from spendguard.ledger import BudgetOverride

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")


class SlowLedger:
    """The ledger's two reads, each answering what was stored when it began, after a gate
    the test opens: a read in flight while the value changes."""

    def __init__(self, override: BudgetOverride | None, topped_up: int | None) -> None:
        self.override, self.topped_up = override, topped_up
        self.reads = 0
        self.reading = anyio.Event()
        self.gate = anyio.Event()

    async def _slow(self, value: Any) -> Any:
        self.reads += 1
        self.reading.set()
        await self.gate.wait()
        return value

    async def budget_override(self, team: str, api_key: str) -> BudgetOverride | None:
        return await self._slow(self.override)  # type: ignore[no-any-return]

    async def customer_topped_up(self, customer: str) -> int | None:
        return await self._slow(self.topped_up)  # type: ignore[no-any-return]


def override(max_tokens: int) -> BudgetOverride:
    return BudgetOverride(ALPHA.team, ALPHA.api_key or "", "acme", "alpha", max_tokens, "24h")


async def test_an_override_changed_while_it_is_being_read_is_read_again() -> None:
    ledger = SlowLedger(override(1000), None)
    cache = OverrideCache(ledger, ttl=60)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(cache.get, ALPHA)
        await ledger.reading.wait()  # the read of 1,000 tokens is in flight
        ledger.override = override(10)  # the admin API lowers it, and evicts
        cache.evict(ALPHA.team, ALPHA.api_key or "")
        ledger.gate.set()
    assert cache.peek(ALPHA) == (False, None)  # the read that began before is not kept
    found = await cache.get(ALPHA)
    assert found is not None and found.max_tokens == 10 and ledger.reads == 2
    assert cache.peek(ALPHA) == (True, found)  # a read after the change is kept


async def test_a_top_up_written_while_the_balance_is_being_read_stays_in_force() -> None:
    ledger = SlowLedger(None, 100)
    balances = CustomerBalances(ledger, ttl=60)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(balances.get, "initech")
        await ledger.reading.wait()
        ledger.topped_up = 600
        balances.set("initech", 600)  # this process's top-up
        ledger.gate.set()
    assert balances.peek("initech") == (True, 600)
    assert await balances.get("initech") == 600 and ledger.reads == 1
