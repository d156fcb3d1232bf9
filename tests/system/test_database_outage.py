"""The database down under traffic for longer than the record writer's backoff takes to reach
its cap: records are buffered (bounded) and written after it recovers, none lost or duplicated;
limits keep being enforced from the cache meanwhile."""

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

# The writer retries after 0.05 s, doubling up to its 5 s cap (Recorder's retry_max): the cap
# is first slept 6.35 s into the outage, so 12 s see a whole sleep at the cap and a failed retry
# after it: the steady state of any longer outage (it was 30 s; set more to hold it longer).
OUTAGE_SECONDS = float(os.environ.get("SPENDGUARD_TEST_OUTAGE_SECONDS", "12"))


@pytest.mark.timeout(300)
async def test_database_down_past_the_writers_backoff_cap_under_traffic(
    clean_postgres_url: str, tmp_path: Path
) -> None:
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


POLICY_TTL = 1.0


@pytest.mark.timeout(120)
async def test_a_database_outage_of_3_policy_ttls_keeps_every_cached_policy(
    clean_postgres_url: str, tmp_path: Path
) -> None:
    """Stale while revalidate: with the ledger unreachable for 3x the policy TTL, a team with
    a limit keeps it (its requests pass, then hit it), a team without any limit keeps passing,
    and only a team this process never read gets a 503."""
    server, db = clean_postgres_url.rsplit("/", 1)
    async with TcpProxy(int(server.rsplit(":", 1)[1])) as proxy:
        url = f"{server.rsplit(':', 1)[0]}:{proxy.port}/{db}"
        async with Gateway(
            tmp_path,
            lambda: datetime.now(UTC),
            database_url=url,
            policy_ttl=POLICY_TTL,
            db_timeout=0.5,
        ) as gw:
            await gw.policy(Period.DAY, 15 * 40)  # acme/alpha: 40 requests of 15 micro-USD
            async with gw.client() as c:

                async def post(team: str) -> int:
                    headers = {"x-test-team": team}
                    r = await c.post("/v1/chat/completions", json=chat_body(), headers=headers)
                    return r.status_code

                assert await post("acme") == await post("free") == 200  # both policies read
                proxy.down()
                statuses: dict[str, list[int]] = {"acme": [], "free": []}
                deadline = time.monotonic() + 3 * POLICY_TTL + 0.5
                while time.monotonic() < deadline:
                    for team in statuses:
                        statuses[team].append(await post(team))
                    await anyio.sleep(0.02)
                never_seen = await post("newcomer")
                await proxy.up()
            # The limit held: 39 more requests fitted, the rest were refused; no 5xx at all.
            assert statuses["acme"].count(200) == 39
            assert set(statuses["acme"]) == {200, 429} and statuses["acme"][-1] == 429
            assert set(statuses["free"]) == {200}
            assert never_seen == 503
