"""A gateway as a host app builds one, with the admin routes mounted: spendguard's middleware
added to the app (behind the host's auth), ``admin_app(app)`` mounted at ``/admin/spendguard``,
the lifespan run, on SQLite + the embedded store or on PostgreSQL + Redis."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from spendguard import Settings, SpendGuardMiddleware
from spendguard.asgi import admin_app
from tests.support import StateAuth, chat_body, lifespan, upstream, write_unit_prices

TOKEN = "adm-" + "x" * 28
AUTH = {"authorization": f"Bearer {TOKEN}"}
PREFIX = "/admin/spendguard"


@dataclass
class AdminGateway:
    app: Starlette
    settings: Settings
    client: httpx.AsyncClient  # the whole app, in process
    backend: str

    @property
    def middleware(self) -> SpendGuardMiddleware:
        found: Any = self.app.middleware_stack
        while not isinstance(found, SpendGuardMiddleware):
            found = found.app
        return found

    async def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**AUTH, **kwargs.pop("headers", {})}
        return await self.client.request(method, PREFIX + path, headers=headers, **kwargs)

    async def chat(self, key: str = "alpha", team: str = "acme", **extra: Any) -> httpx.Response:
        return await self.client.post(
            "/v1/chat/completions",
            json=chat_body(**extra),
            headers={"x-test-team": team, "x-test-key": key},
        )


def build_app(settings: Settings) -> Starlette:
    """The host app: its routes, spendguard behind its auth, the admin routes mounted."""
    app = upstream()
    app.add_middleware(SpendGuardMiddleware, settings=settings)
    app.add_middleware(StateAuth)
    app.mount(PREFIX, admin_app(app))
    return app


def make_settings(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest, **extra: Any
) -> Settings:
    fields: dict[str, Any] = {
        "prices": write_unit_prices(tmp_path),
        "admin_token": TOKEN,
        "settle_interval": 3600,  # tests settle when they want to (POST through the guard)
    }
    if backend == "sqlite":
        fields["database_url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        fields["database_url"] = request.getfixturevalue("clean_postgres_url")
        fields["redis_url"] = request.getfixturevalue("redis_url")
        fields["key_prefix"] = "adm" + secrets.token_hex(4)
    return Settings(**(fields | extra))


@pytest.fixture(params=["sqlite", "postgres_redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def settings(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    return make_settings(tmp_path, backend, request)


@pytest.fixture
async def gw(backend: str, settings: Settings) -> AsyncIterator[AdminGateway]:
    app = build_app(settings)
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
    ):
        yield AdminGateway(app, settings, client, backend)


@pytest.fixture
def budget_settings(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    section = {
        "enabled": True,
        "storage": "memory" if backend == "sqlite" else "redis",
        "windows": [{"id": "hourly", "period": "1h"}],
        "scopes": {"global": {"tokens": 1000}, "per_api_key": {"tokens": 500}},
    }
    return make_settings(tmp_path, backend, request, budgets=section)


@pytest.fixture
async def bgw(backend: str, budget_settings: Settings) -> AsyncIterator[AdminGateway]:
    app = build_app(budget_settings)
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
    ):
        yield AdminGateway(app, budget_settings, client, backend)
