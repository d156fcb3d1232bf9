"""Shared fixtures: real SQLite files and a fresh PostgreSQL database per test session.

PostgreSQL comes from ``SPENDGUARD_TEST_POSTGRES_URL`` (default: the local server as user
``postgres``). Each run creates its own database and drops it afterwards. Without a server the
PostgreSQL tests skip locally but FAIL under ``CI=true``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from spendguard.ledger import Ledger

PG_ADMIN_URL = os.environ.get(
    "SPENDGUARD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _pg_server_url() -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    import asyncio

    import asyncpg

    name = f"spendguard_test_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:
        if IN_CI:
            pytest.fail(f"PostgreSQL is required under CI=true: {exc!r}")
        pytest.skip(f"no PostgreSQL server: {exc!r}")
    try:
        yield f"{_pg_server_url()}/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty ledger database on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    base: str = request.getfixturevalue("postgres_url")
    _truncate_pg(base)
    return base


def _truncate_pg(url: str) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            await conn.execute(
                "DO $$ DECLARE t text; BEGIN FOR t IN SELECT tablename FROM pg_tables "
                "WHERE schemaname = 'public' AND tablename LIKE 'spendguard_%' LOOP "
                "EXECUTE 'TRUNCATE ' || quote_ident(t); END LOOP; END $$"
            )
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture
def clean_postgres_url(postgres_url: str) -> str:
    """The session's PostgreSQL database, emptied for this test."""
    _truncate_pg(postgres_url)
    return postgres_url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
async def ledger(database_url: str) -> AsyncIterator[Ledger]:
    led = Ledger(database_url)
    await led.connect()
    await led.init_schema()
    try:
        yield led
    finally:
        await led.disconnect()


# Private redis-server processes (never the shared 6379 one): redis_url, redis_server,
# shared_redis, redis_cluster.
from tests.redis_servers import *  # noqa: E402, F403
