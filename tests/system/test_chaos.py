"""Redis killed, paused and flushed under concurrent traffic, failing closed and open: every
inference that was served is recorded and charged exactly once, and afterwards the cache
equals the ledger to the micro-USD. On asyncio's event loop and on uvloop: a broken or hung
connection ends through each loop's own transports and timers.

(The other faults of the chaos suite live next to what they break: a gateway killed with
SIGKILL in ``test_crash.py`` / ``test_crash_redis.py``, the database cut for 3 policy TTLs in
``test_database_outage.py``, the 200 burst in ``test_burst.py``, a poison record in
``tests/engine/test_recorder.py`` and ``test_recovery.py``, out-of-range amounts in
``tests/test_cli.py`` and ``tests/engine/test_admin.py``.)
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from spendguard import Identity
from spendguard.clock import utcnow
from spendguard.ledger.schema import charges, records
from spendguard.limits import Period, key_limit
from spendguard.store.redis import RedisStore
from tests.support import Gateway, RedisServer, chat_body
from tests.support.sql import sql_value

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]

CLIENTS = 8
FAULT_SECONDS = 1.0


async def _fault(server: RedisServer, fault: str) -> None:
    if fault == "kill":
        server.kill()  # every key and script gone; pooled sockets dead
        await anyio.sleep(FAULT_SECONDS)
        server.restart()
    elif fault == "pause":
        server.pause()  # connections stay open, nothing answers
        await anyio.sleep(FAULT_SECONDS)
        server.resume()
    else:
        server.cli("FLUSHALL")  # keys and markers gone while requests are in flight


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["closed", "open"])
@pytest.mark.parametrize("fault", ["kill", "pause", "flush"])
async def test_redis_faults_under_traffic_keep_the_accounting_exact(
    tmp_path: Path, redis_server: RedisServer, fault: str, mode: str
) -> None:
    store = RedisStore.from_url(redis_server.url, timeout=0.25)
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    served = 0
    refused = 0
    async with Gateway(tmp_path, utcnow, store=store, database_url=db, fail_mode=mode) as gw:
        await gw.policy(Period.DAY, 10**12)
        async with gw.client() as c:
            stop = anyio.Event()

            async def client() -> None:
                nonlocal served, refused
                while not stop.is_set():
                    r = await c.post("/v1/chat/completions", json=chat_body())
                    if r.status_code == 200:
                        served += 1
                    else:
                        assert r.status_code == 503, r.text  # fail closed: refused, not a 500
                        refused += 1
                        await anyio.sleep(0.01)

            async with anyio.create_task_group() as tg:
                for _ in range(CLIENTS):
                    tg.start_soon(client)
                await anyio.sleep(0.5)
                await _fault(redis_server, fault)
                await anyio.sleep(0.5)  # traffic goes on after it
                stop.set()
        assert served > 0
        if mode == "open":
            assert refused == 0  # fail open: served through the outage, tracked locally
        await gw.settle()
        await gw.settle()  # the first pass may find keys the fault dropped: fill and refresh
        key = gw.guard.codec.check(key_limit(Identity("acme", "alpha"), Period.DAY), utcnow())
        # One more inference fills the key from the ledger if the fault dropped it.
        assert (await gw.post()).status_code == 200
        served += 1
        await gw.settle()
        cached = (await store.read_usage([key.usage_key]))[key.usage_key]
        pending = redis_server.cli("HGET", key.usage_key, "p").strip()
    records_n = await sql_value(db, sa.select(sa.func.count()).select_from(records))
    charges_n = await sql_value(db, sa.select(sa.func.count()).select_from(charges))
    total = await sql_value(db, sa.select(sa.func.sum(charges.c.amount_micros)))
    assert records_n == served  # every served inference recorded, none twice
    assert charges_n == records_n  # each charged exactly once
    assert cached == total and int(pending or 0) == 0  # the cache equals the ledger, exactly
    assert redis_server.cli("KEYS", "*:spend:open").strip() == ""  # no admission entry left
    await store.aclose()
