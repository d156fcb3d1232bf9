"""Processes for the scale test: a gateway app and a settlement worker on an injected clock.

Run from the repository root: ``uvicorn tests.system.scale_app:make_app --factory`` for a
gateway, ``python -m tests.system.scale_app`` for a worker.

The clock is shared across processes: ``SCALE_T0`` (ISO time) is what the clock reads at the
real instant ``SCALE_REF`` (epoch seconds); it then runs at real speed. Tests start it just
before a UTC midnight that is also a month end.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

import anyio

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.engine.costing import Coster
from spendguard.engine.pricing import PriceTable
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger import Ledger
from spendguard.limits import KeyCodec
from spendguard.store.redis import RedisStore
from spendguard.testing import fake_upstream
from tests.support import StateAuth


def injected_clock() -> datetime:
    t0 = datetime.fromisoformat(os.environ["SCALE_T0"])
    return t0 + timedelta(seconds=time.time() - float(os.environ["SCALE_REF"]))


def make_app() -> StateAuth:
    guard = SpendGuard(Settings(), clock=injected_clock)
    return StateAuth(SpendGuardMiddleware(fake_upstream(), guard=guard))


async def run_worker() -> None:
    settings = Settings()
    ledger = Ledger(settings.database_url.get_secret_value())
    await ledger.connect()
    await ledger.init_schema()
    assert settings.redis_url is not None
    store = RedisStore.from_url(settings.redis_url.get_secret_value(), timeout=2)
    coster = Coster(PriceTable.load(settings.prices), settings.unknown_model)
    worker = SettlementWorker(
        ledger,
        store,
        coster,
        KeyCodec(settings.key_prefix, timedelta(seconds=settings.key_grace)),
        batch_size=500,
        clock=injected_clock,
    )
    await worker.run(0.2)


if __name__ == "__main__":
    anyio.run(run_worker)
