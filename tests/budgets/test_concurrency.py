"""200 concurrent requests against a key budget worth K admission estimates admit exactly K,
on memory, a real redis-server and a real 3-master cluster. Every admitted request is held
inside the app until all 200 have been answered or admitted, so no hold is replaced early."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from starlette.types import Receive, Scope, Send

from tests.support.budgets import BudgetGateway, section
from tests.support.gateway import chat_body, upstream

pytestmark = pytest.mark.anyio

K = 7
EST = 100  # max_tokens=98 + the 2-token prompt
N = 200


async def test_concurrent_requests_never_overrun_a_key_budget(
    tmp_path: Path, storage: dict[str, object]
) -> None:
    inner = upstream()
    release = anyio.Event()
    entered = 0

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal entered
        if scope["type"] == "http":
            entered += 1
            await release.wait()
        await inner(scope, receive, send)

    kind = "redis" if storage else "memory"
    budgets = section(storage=kind, scopes={"per_api_key": {"tokens": K * EST}})
    statuses: list[int] = []
    gw = BudgetGateway(tmp_path, budgets=budgets, app=gated, **storage)
    async with gw, gw.client() as c:

        async def one() -> None:
            r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))
            statuses.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(N):
                tg.start_soon(one)
            with anyio.fail_after(30):
                while entered + len(statuses) < N:
                    await anyio.sleep(0.01)
            admitted_while_held = entered
            release.set()
    assert admitted_while_held == K
    assert statuses.count(200) == K and statuses.count(429) == N - K
