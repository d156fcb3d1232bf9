"""Two gateway processes, one Redis, one PostgreSQL: 200 concurrent requests against one key.

The cached usage must equal the sum of the estimates before settlement and the sum of the
exact charges after it, to the micro-USD. Both gateways run on asyncio's event loop, then both
on uvloop.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from spendguard import Identity
from spendguard.ledger import Ledger
from spendguard.limits import KeyCodec, Period, key_limit, team_limit
from spendguard.store.redis import RedisStore
from tests.support import call_cli, clean_env, free_port, run_cli, stop, uvicorn, wait_healthy

ALPHA_DAY = ("--team", "acme", "--api-key", "alpha", "--period", "day")


@pytest.fixture
def env(clean_postgres_url: str, redis_url: str) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_DATABASE_URL=clean_postgres_url,
        SPENDGUARD_REDIS_URL=redis_url,
        SPENDGUARD_RUN_WORKER="false",  # settle only when the test says so
        SPENDGUARD_SETTLE_INTERVAL="3600",
        SPENDGUARD_REDIS_TIMEOUT="2",
    )


@pytest.fixture
def gateways(env: dict[str, str], tmp_path: Path, loop: str) -> Iterator[list[str]]:
    procs, bases, logs = [], [], []
    try:
        for n in range(2):
            port, log = free_port(), tmp_path / f"gw{n}.log"
            procs.append(uvicorn("examples.gateway:app", port, env, log, loop=loop))
            bases.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        for base, proc, log in zip(bases, procs, logs, strict=True):
            wait_healthy(base, proc, log)
        yield bases
    finally:
        stop(procs, timeout=20)  # graceful: each flushes its record buffer


@pytest.mark.timeout(300)
@pytest.mark.both_loops
def test_two_gateways_200_concurrent_requests_one_key(
    gateways: list[str], env: dict[str, str], clean_postgres_url: str, redis_url: str
) -> None:
    run_cli(env, "policy", "set", *ALPHA_DAY, "--limit-usd", "1000")
    # The same command again needs no process of its own (the one above is real).
    call_cli(env, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "1000")

    async def fire() -> list[int]:
        statuses: list[int] = []
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:

            async def one(i: int) -> None:
                body: dict[str, Any] = {
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "x" * (i % 37)}],
                }
                if i % 3 == 1:
                    body.update(stream=True, stream_options={"include_usage": True})
                elif i % 3 == 2:
                    body.update(stream=True)  # no usage: estimated
                r = await client.post(
                    f"{gateways[i % 2]}/v1/chat/completions",
                    json=body,
                    headers={"authorization": "Bearer sk-demo-alpha"},
                )
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
        return statuses

    assert anyio.run(fire) == [200] * 200

    async def check() -> None:
        store = RedisStore.from_url(redis_url, timeout=2)
        ledger = Ledger(clean_postgres_url)
        await ledger.connect()
        alpha = Identity("acme", "alpha")
        p = KeyCodec("quota", timedelta(days=2)).plan(alpha, datetime.now(UTC))
        limits = (key_limit(alpha, Period.DAY), team_limit(alpha, Period.MONTH))
        keys = [p.find(limit).usage_key for limit in limits]
        try:
            with anyio.fail_after(20):
                while (await ledger.unsettled())[0] < 200:  # the writers flush in the background
                    await anyio.sleep(0.1)
            count, estimates = await ledger.unsettled()
            assert count == 200
            cached = await store.read_usage(keys)
            assert set(cached.values()) == {estimates}  # before settlement: sum of estimates

            result = run_cli(env, "settle")
            assert result["settled"] == 200
            charges = await ledger.charges_total("acme")
            cached = await store.read_usage(keys)
            assert set(cached.values()) == {charges}  # after: sum of exact charges
            assert await ledger.unsettled() == (0, 0)
        finally:
            await ledger.disconnect()
            await store.aclose()

    anyio.run(check)
