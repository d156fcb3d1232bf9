"""Tests for spendguard.asgi.lifespan: the middleware starts and stops the guard's background
tasks with the host app's lifespan, also when the app itself has no lifespan support."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import redis as sync_redis

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from tests.support import (
    RedisServer,
    StateAuth,
    chat_body,
    client,
    lifespan,
    upstream,
    write_unit_prices,
)
from tests.support.services import require_redis_server, started_redis

pytestmark = pytest.mark.anyio


def settings(tmp_path: Path) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'l.db'}",
        prices=write_unit_prices(tmp_path),
        settle_interval=0.05,
    )


async def serve_one_and_wait_for_settlement(middleware: SpendGuardMiddleware) -> SpendGuard:
    """Inside the app's lifespan: one request, then the in-app worker settles it."""
    app = StateAuth(middleware)
    guard = middleware.guard
    assert guard is not None
    async with lifespan(app):
        assert guard.running
        async with client(app) as c:
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        with anyio.fail_after(5):
            while not await guard.ledger.charges_total():  # the in-app worker settles it
                await anyio.sleep(0.05)
    return guard


async def test_lifespan_starts_and_stops_the_background_tasks(tmp_path: Path) -> None:
    guard = await serve_one_and_wait_for_settlement(
        SpendGuardMiddleware(upstream(), settings(tmp_path))
    )
    assert not guard.running
    assert guard.recorder.pending == 0


@pytest.mark.parametrize("behaviour", ["raises", "returns"])
async def test_app_without_lifespan_support_still_gets_the_worker(
    tmp_path: Path, behaviour: str
) -> None:
    inner = upstream()

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            if behaviour == "raises":
                raise RuntimeError("lifespan? never heard of it")
            return
        await inner(scope, receive, send)

    guard = await serve_one_and_wait_for_settlement(SpendGuardMiddleware(bare, settings(tmp_path)))
    assert not guard.running


async def test_a_guard_on_redis_closes_its_connections_when_the_app_stops_and_reconnects(
    tmp_path: Path,
) -> None:
    """The Redis client a guard made for itself is closed with the app's lifespan (a host
    that starts and stops apps, as tests do, leaks no sockets), and a guard started again
    connects again."""
    require_redis_server()
    server = started_redis(RedisServer())  # its own: the clients counted are only ours
    try:
        probe = sync_redis.Redis(port=server.port)

        def clients() -> int:
            return int(probe.info("clients")["connected_clients"]) - 1  # not the probe

        before = clients()
        on_redis = Settings(
            database_url=f"sqlite:///{tmp_path / 'l.db'}",
            prices=write_unit_prices(tmp_path),
            redis_url=server.url,
            key_prefix="lifespan",
        )
        middleware = SpendGuardMiddleware(upstream(), on_redis)
        app = StateAuth(middleware)
        for _ in range(2):  # started, stopped, started again
            async with lifespan(app):
                async with client(app) as c:
                    answer = await c.post("/v1/chat/completions", json=chat_body())
                assert answer.status_code == 200
                assert clients() > before
            with anyio.fail_after(5):
                while clients() > before:
                    await anyio.sleep(0.05)
        probe.close()
    finally:
        server.stop()
