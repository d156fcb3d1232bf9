"""Test helpers: an ASGI lifespan driver, a settable clock, identity-setting auth, failing parts,
ledger probes."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import sqlalchemy as sa
from databases import Database
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spendguard.ledger.schema import topups

# A price table where one token costs exactly one micro-USD, so expected charges are obvious.
UNIT_PRICES = {
    "as_of": "2026-11-01",
    "models": {
        "unit-model": {"input": "1", "output": "1", "cached_input": "1"},
        "default": {"input": "1", "output": "1"},
    },
}


def write_unit_prices(tmp_path: Path) -> Path:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(UNIT_PRICES))
    return path


class Clock:
    def __init__(self, now: datetime | None = None) -> None:
        self.now = now or datetime(2026, 9, 30, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class StateAuth:
    """What a host app's auth middleware does: put the identity into the request state."""

    def __init__(self, app: ASGIApp, team: str | None = "acme", key: str | None = "alpha") -> None:
        self.app, self.team, self.key = app, team, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.team is not None:
            state = scope.setdefault("state", {})
            headers = dict(scope["headers"])
            state["team_id"] = headers.get(b"x-test-team", self.team.encode()).decode()
            state["api_key_id"] = (
                headers.get(b"x-test-key", (self.key or "").encode()).decode() or None
            )
        await self.app(scope, receive, send)


class Exploding:
    """A store or ledger that fails the test on any use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls: list[str] = []

    def __getattr__(self, attr: str) -> Any:
        self.calls.append(attr)
        raise AssertionError(f"{self._name}.{attr} used on a path that must not touch it")


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run an ASGI app's lifespan around a block, as a server would."""
    to_app_send, to_app_recv = anyio.create_memory_object_stream[Message](10)
    from_app_send, from_app_recv = anyio.create_memory_object_stream[Message](10)

    async def receive() -> Message:
        return await to_app_recv.receive()

    async def send(message: Message) -> None:
        await from_app_send.send(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(
            app, {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send
        )
        await to_app_send.send({"type": "lifespan.startup"})
        started = await from_app_recv.receive()
        if started["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"startup failed: {started}")
        try:
            yield
        finally:
            await to_app_send.send({"type": "lifespan.shutdown"})
            done = await from_app_recv.receive()
            assert done["type"] == "lifespan.shutdown.complete", done


async def sql_rows(url: str, query: Any) -> list[tuple[Any, ...]]:
    """Run one query on its own connection: tests read the ledger's tables directly, as an
    operator would, without reaching into the ledger object."""
    db = Database(url)
    await db.connect()
    try:
        return [tuple(r._mapping.values()) for r in await db.fetch_all(query)]
    finally:
        await db.disconnect()


async def topups_total(url: str, team: str) -> int:
    """The sum of a team's top-ups, read from the top-up log (not the account) as a cross-check."""
    query = sa.select(sa.func.coalesce(sa.func.sum(topups.c.amount_micros), 0)).where(
        topups.c.team == team
    )
    return int((await sql_rows(url, query))[0][0])


class Counting:
    """A collaborator (a store, a ledger) that counts the calls made to it, per method, and
    forwards them: tests show which requests never reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted

    def __len__(self) -> int:
        return len(self.inner)
