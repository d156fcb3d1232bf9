"""Many requests released at the same instant: every task waits on one event, so none has
its answer before the last one is sent (what a limit must hold against)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import httpx


async def released_together(count: int, call: Callable[[], Awaitable[httpx.Response]]) -> list[int]:
    """The statuses of ``count`` concurrent ``call()``s, started together."""
    statuses: list[int] = []
    ready = anyio.Event()

    async def one() -> None:
        await ready.wait()
        statuses.append((await call()).status_code)

    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(one)
        await anyio.sleep(0.2)  # every task is waiting on the event
        ready.set()
    return statuses
