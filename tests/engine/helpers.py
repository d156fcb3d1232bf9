"""What the worker and cache-sync tests share: one identity and its daily key limit, spending
through a guard, reading its cache, and a worker pricing at twice the estimate's rate.

Plain helpers for the tests of this package: no fixtures and no tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from spendguard import Identity, Settings, SpendGuard
from spendguard.engine.costing import Coster
from spendguard.engine.pricing import PriceTable
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger import Ledger
from spendguard.limits import Period, Policy, key_limit
from spendguard.settings import UnknownModel
from spendguard.store import Store
from spendguard.store.memory import MemoryStore
from spendguard.usage import Usage
from tests.support import Clock


@asynccontextmanager
async def running_guard(settings: Settings) -> AsyncIterator[SpendGuard]:
    """A started guard on the embedded store and a fixed clock (settlement only when a test
    asks), stopped afterwards."""
    clock = Clock()
    g = SpendGuard(settings, store=MemoryStore(clock=clock), clock=clock)
    await g.start(worker=False)
    try:
        yield g
    finally:
        await g.stop()


ALPHA = Identity("acme", "alpha")
KEY_DAY = key_limit(ALPHA, Period.DAY)


async def set_limit(g: SpendGuard, limit: int) -> None:
    """The ledger only, as another process would: this cache learns of it from a pass."""
    await g.ledger.set_policy(Policy(KEY_DAY, limit, "acme", "alpha"), now=g.clock())


def day_key(g: SpendGuard) -> str:
    return g.codec.check(KEY_DAY, g.clock()).usage_key


async def spend(g: SpendGuard, tokens: int, *, reported: bool = True) -> str:
    decision = await g.preflight(ALPHA, g.clock())
    usage = Usage(input_tokens=tokens, estimated=not reported)
    record = await g.postflight(
        decision, model="unit-model", route="/v1/chat/completions", status_code=200, usage=usage
    )
    assert record is not None
    return record.id


async def cached(g: SpendGuard) -> int | None:
    return (await g.store.read_usage([day_key(g)]))[day_key(g)]


def doubled_worker(
    g: SpendGuard, store: Store | None = None, *, ledger: Ledger | None = None
) -> SettlementWorker:
    """A worker pricing at twice the estimate's rate, so exact charges differ from estimates
    and a test can tell "estimate replaced by charge" from "charge added on top". With
    ``ledger`` (a connection of its own) it settles as another process would."""
    doubled_path = Path(str(g.settings.prices))
    text = doubled_path.read_text().replace('"1"', '"2"')
    doubled_path.with_name("double.json").write_text(text)
    doubled = PriceTable.load(doubled_path.with_name("double.json"))
    coster = Coster(doubled, UnknownModel.DEFAULT_PRICE)
    return SettlementWorker(ledger or g.ledger, store, coster, g.codec, clock=g.clock)
