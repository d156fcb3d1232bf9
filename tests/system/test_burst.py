"""A burst on a healthy Redis: 200 requests at once against one gateway process, default
timeouts. Every request must be checked and charged through Redis: no 503 (fail closed) and no
fail-open admission (fail open) just because the requests arrived together.

A false "Redis unavailable" under a burst is what a deadline measured from the start of the
call (event-loop queueing included) produces: the test fails if the Redis path counts waiting
for its turn as Redis being slow. The gateway runs on asyncio's event loop and on uvloop
(uvicorn's default wherever it is installed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import sqlalchemy as sa

from spendguard.ledger import Ledger
from spendguard.ledger.schema import records
from tests.support import call_cli, clean_env, free_port, run_cli, stop, uvicorn, wait_healthy
from tests.support.burst import released_together
from tests.support.sql import sql_rows

BURST = 200


@pytest.fixture(params=["closed", "open"])
def gateway(
    request: pytest.FixtureRequest,
    clean_postgres_url: str,
    redis_url: str,
    tmp_path: Path,
    loop: str,
) -> Iterator[tuple[str, dict[str, str], Path]]:
    env = clean_env(
        SPENDGUARD_DATABASE_URL=clean_postgres_url,
        SPENDGUARD_REDIS_URL=redis_url,
        SPENDGUARD_FAIL_MODE=request.param,
        SPENDGUARD_RUN_WORKER="false",
        # Every other Redis setting stays at its default: the burst must hold with them.
    )
    port, log = free_port(), tmp_path / "gateway.log"
    proc = uvicorn("examples.gateway:app", port, env, log, loop=loop)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield base, env, log
    finally:
        stop([proc], timeout=20)  # graceful: the record buffer is flushed


@pytest.mark.timeout(300)
@pytest.mark.both_loops
def test_a_burst_of_200_on_a_healthy_redis_is_checked_and_charged_through_redis(
    gateway: tuple[str, dict[str, str], Path], clean_postgres_url: str
) -> None:
    base, env, log = gateway
    run_cli(env, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "1000")
    # The same command again needs no process of its own (the one above is real).
    call_cli(
        env, "policy", "set", "--team", "acme", "--api-key", "alpha", "--period", "day",
        "--limit-usd", "1000",
    )  # fmt: skip
    headers = {"authorization": "Bearer sk-demo-alpha"}
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=BURST)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            # One warm request: the policy and usage keys are cached, as in steady traffic.
            warm = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert warm.status_code == 200, warm.text
            return await released_together(
                BURST, lambda: client.post("/v1/chat/completions", json=body, headers=headers)
            )

    statuses = anyio.run(burst)
    assert sorted(statuses) == [200] * BURST, {s: statuses.count(s) for s in set(statuses)}

    async def postflights() -> dict[str, int]:
        ledger = Ledger(clean_postgres_url)
        await ledger.connect()
        try:
            with anyio.fail_after(30):  # the record writer flushes in the background
                while (await ledger.unsettled())[0] < BURST + 1:
                    await anyio.sleep(0.1)
        finally:
            await ledger.disconnect()
        query = sa.select(records.c.postflight, sa.func.count()).group_by(records.c.postflight)
        return {status: int(n) for status, n in await sql_rows(clean_postgres_url, query)}

    # A fail-open admission has no cached limits to charge: its postflight is "skipped". An
    # outcome lost to a timeout is "unknown". Every one of the burst was applied in Redis.
    assert anyio.run(postflights) == {"applied": BURST + 1}
    text = log.read_text()
    assert "store unavailable" not in text and "outcome unknown" not in text, text[-2000:]
