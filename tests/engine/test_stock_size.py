"""How many holds a shelf keeps (engine/stock.py): 8 at first, doubled by a refill after
requests found the shelf empty, up to the gateway's most, and a quarter less after a refill
with none, down to 8 again. The store is a recording stand-in that grants every id asked
for: what is decided here is only how many are asked for."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable
from types import SimpleNamespace
from typing import Any

import pytest

from spendguard.engine.stock import START, Shelf, Stock
from spendguard.store.rolling import Hold

pytestmark = pytest.mark.anyio

HOLD = Hold(id="", now_ms=0, expires_ms=60_000, tokens=10, cost=0, count_cost=False, ttl_ms=1)
FRESH_MS = 10**9  # nothing goes stale here


async def _value(n: int) -> int:
    return n


class Granting:
    """Grants every id a refill asks for, and records how many that was."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def stock_bucket(self, call: Any, hold: Hold, ids: list[str], share: int, **_: Any) -> Any:
        self.asked.append(len(ids))
        return _value(len(ids))

    def release_stock(self, bucket: Any, ids: list[str]) -> Awaitable[int]:
        return _value(len(ids))


ids = (f"id{i}" for i in itertools.count())


def setup(most: int) -> tuple[Stock, Shelf, Granting]:
    stock = Stock(most, 4)
    shelf = stock.shelf(object(), "m", (SimpleNamespace(bucket="b"),))  # type: ignore[arg-type]
    return stock, shelf, Granting()


async def refill(stock: Stock, shelf: Shelf, store: Granting) -> bool:
    sent = stock.refill(shelf, store, HOLD, lambda: next(ids), FRESH_MS, False)  # type: ignore[arg-type]
    if sent is None:
        return False
    await sent
    return True


def burst(stock: Stock, shelf: Shelf, n: int) -> int:
    """``n`` requests come for an id before any refill lands: how many got one."""
    return sum(stock.take(shelf, HOLD, FRESH_MS) is not None for _ in range(n))


async def test_a_shelf_grows_while_bursts_find_it_empty_and_stops_at_the_most() -> None:
    stock, shelf, store = setup(64)
    assert await refill(stock, shelf, store)
    assert store.asked == [START] and len(shelf.ids) == START
    for wave, want in ((20, 16), (40, 32), (100, 64), (100, 64)):
        held = len(shelf.ids)
        assert burst(stock, shelf, wave) == held < wave  # the shelf ran dry: some missed
        assert await refill(stock, shelf, store)
        assert shelf.target == want and len(shelf.ids) == want


async def test_without_misses_a_shelf_shrinks_back_to_where_it_started() -> None:
    stock, shelf, store = setup(64)
    await refill(stock, shelf, store)
    for wave in (20, 40, 100):
        burst(stock, shelf, wave)
        await refill(stock, shelf, store)
    assert shelf.target == 64
    targets = []
    for _ in range(400):  # one request at a time: each finds an id
        assert burst(stock, shelf, 1) == 1
        if await refill(stock, shelf, store):
            targets.append(shelf.target)
    assert targets[:3] == [48, 36, 27]
    assert targets[-1] == START and min(targets) == START
    assert targets == sorted(targets, reverse=True)


async def test_a_shelf_never_holds_more_than_the_gateways_most() -> None:
    stock, shelf, store = setup(5)  # a most below the start: the start is the most
    await refill(stock, shelf, store)
    for _ in range(5):
        burst(stock, shelf, 50)
        await refill(stock, shelf, store)
    assert max(store.asked) == 5 and shelf.target == 5 and len(shelf.ids) == 5
