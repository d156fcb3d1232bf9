"""The database down for 30 s under traffic: records are buffered (bounded) and written after
it recovers, none lost or duplicated; limits keep being enforced from the cache meanwhile."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from spendguard.limits import Period
from tests.support import Gateway, TcpProxy, chat_body

pytestmark = pytest.mark.anyio

OUTAGE_SECONDS = float(os.environ.get("SPENDGUARD_TEST_OUTAGE_SECONDS", "30"))


@pytest.mark.timeout(300)
async def test_database_down_for_30s_under_traffic(clean_postgres_url: str, tmp_path: Path) -> None:
    server, db = clean_postgres_url.rsplit("/", 1)
    async with TcpProxy(int(server.rsplit(":", 1)[1])) as proxy:
        url = f"{server.rsplit(':', 1)[0]}:{proxy.port}/{db}"
        async with Gateway(tmp_path, lambda: datetime.now(UTC), database_url=url) as gw:
            await gw.policy(Period.DAY, 10**9)
            sent = 0
            async with gw.client() as c:
                assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
                sent += 1
                await gw.guard.recorder.flush()
                proxy.down()  # the database is unreachable from here on
                deadline = time.monotonic() + OUTAGE_SECONDS
                while time.monotonic() < deadline:
                    r = await c.post("/v1/chat/completions", json=chat_body())
                    assert r.status_code == 200  # warm cache: no SQL on the request path
                    sent += 1
                    await anyio.sleep(0.05)
                buffered = gw.guard.recorder.pending
                assert buffered >= sent - 1  # every outage record held while the writer retries
                await proxy.up()
                with anyio.fail_after(30):
                    while gw.guard.recorder.pending:
                        await anyio.sleep(0.1)
            assert gw.guard.recorder.dropped == 0
            count, estimates = await gw.guard.ledger.unsettled()
            assert count == sent and estimates == 15 * sent  # every record, exactly once
            await gw.settle()
            assert await gw.guard.ledger.charges_total() == 15 * sent
