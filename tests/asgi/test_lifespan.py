"""Tests for spendguard.asgi.lifespan: the middleware starts and stops the guard's background
tasks with the host app's lifespan, also when the app itself has no lifespan support."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from tests.support import StateAuth, chat_body, client, lifespan, upstream, write_unit_prices

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
