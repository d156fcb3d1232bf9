"""What the worker and cache-sync tests share: one identity and its daily key limit, spending
through a guard, reading its cache, and a worker pricing at twice the estimate's rate.

Plain helpers for the tests of this package: no fixtures and no tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from spendguard import Identity, Settings, SpendGuard
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger import Ledger, RecordRow
from spendguard.limits import Period, Policy, key_limit
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


class DoubledWorker(SettlementWorker):
    """Charges twice what settlement would. A record is charged the price it was estimated
    at, so charge and estimate agree; doubling makes them differ, as for a record priced by a
    settling table unlike the gateway's (one without a price of its own)."""

    def _price(self, rec: RecordRow) -> int:
        return 2 * super()._price(rec)


def doubled_worker(
    g: SpendGuard, store: Store | None = None, *, ledger: Ledger | None = None
) -> SettlementWorker:
    """A worker charging twice the estimate, so exact charges differ from estimates and a
    test can tell "estimate replaced by charge" from "charge added on top". With ``ledger``
    (a connection of its own) it settles as another process would."""
    return DoubledWorker(ledger or g.ledger, store, g.coster, g.codec, clock=g.clock)
