"""A gateway on the embedded store killed outright (SIGKILL): what a crash can lose is bounded.

The embedded store lives in the gateway's memory and dies with it; the ledger keeps what the
record writer wrote. The writer lingers 25 ms after a record so batches form, then writes in a
worker thread: a record is on disk well within 100 ms of its response's end. The test kills
the gateway half a second after the last response (the bound docs/durability.md states, with a
margin for a loaded CI machine) and finds every served inference in the ledger.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest
import sqlalchemy as sa

from spendguard.ledger.schema import records
from tests.support import clean_env, free_port, uvicorn, wait_healthy
from tests.support.sql import sql_value

REQUESTS = 60


@pytest.mark.timeout(120)
def test_sigkill_after_the_last_response_loses_no_record(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = clean_env(SPENDGUARD_DATABASE_URL=db, SPENDGUARD_RUN_WORKER="false")
    port, log = free_port(), tmp_path / "gateway.log"
    proc = uvicorn("examples.gateway:app", port, env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)

        async def traffic() -> list[int]:
            statuses: list[int] = []
            headers = {"authorization": "Bearer sk-demo-alpha"}
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:

                async def one(i: int) -> None:
                    body: dict[str, object] = {
                        "model": "gpt-4o-mini",
                        "messages": [{"role": "user", "content": "x" * i}],
                        "stream": i % 2 == 0,
                    }
                    r = await client.post("/v1/chat/completions", json=body, headers=headers)
                    await r.aread()
                    statuses.append(r.status_code)

                async with anyio.create_task_group() as tg:
                    for i in range(REQUESTS):
                        tg.start_soon(one, i)
            return statuses

        assert anyio.run(traffic) == [200] * REQUESTS
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)  # no shutdown, no flush
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    written = anyio.run(sql_value, db, sa.select(sa.func.count()).select_from(records))
    assert written == REQUESTS
