"""Shared fixtures: real SQLite files, a fresh PostgreSQL database per test session, private
redis-server processes (never the machine's shared Redis on 6379).

PostgreSQL comes from ``SPENDGUARD_TEST_POSTGRES_URL`` (default: the local server as user
``postgres``). Each run creates its own database and drops it afterwards. Without a server (or
without ``redis-server``) those tests skip locally but FAIL under ``CI=true``.

Async tests run on asyncio's own event loop. A test (or module) marked ``both_loops`` runs
once on it and once on uvloop: its ``loop`` fixture names the loop, which the test's own
coroutine runs on and which a test starting gateway processes passes to uvicorn. Without uvloop
the uvloop variants skip locally and FAIL under ``CI=true`` too.

The launchers and helpers behind these fixtures are in ``tests/support/`` (shared with the
benchmarks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from spendguard.ledger import Ledger
from tests.support import loops
from tests.support.postgres import TemporaryDatabase, truncate_spendguard_tables
from tests.support.redis import RedisCluster, RedisServer
from tests.support.services import created_database, require_loop, started_cluster, started_redis


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_loops: run on asyncio's event loop and on uvloop (the loop fixture)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Only where asked: most tests never touch a socket through the loop, and doubling them
    # all would double the suite's time for nothing.
    if metafunc.definition.get_closest_marker("both_loops") and "loop" in metafunc.fixturenames:
        metafunc.parametrize("loop", loops.LOOPS, indirect=True)


@pytest.fixture
def loop(request: pytest.FixtureRequest) -> str:
    """The event loop this test runs on: asyncio's, unless ``both_loops`` parametrizes it."""
    name: str = getattr(request, "param", "asyncio")
    require_loop(name)
    return name


@pytest.fixture
def anyio_backend(loop: str) -> object:
    return loops.anyio_backend(loop)


# -- SQL ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A database of this session's own on the PostgreSQL server (dropped at the end)."""
    db = created_database(TemporaryDatabase())
    try:
        yield db.url
    finally:
        db.drop()


@pytest.fixture
def clean_postgres_url(postgres_url: str) -> str:
    """The session's PostgreSQL database, emptied for this test."""
    truncate_spendguard_tables(postgres_url)
    return postgres_url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty ledger database on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("clean_postgres_url")
    return url


@pytest.fixture
async def ledger(database_url: str) -> AsyncIterator[Ledger]:
    led = Ledger(database_url)
    await led.connect()
    await led.init_schema()
    try:
        yield led
    finally:
        await led.disconnect()


# -- Redis ----------------------------------------------------------------------------------


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh private server for one test; the test may kill, restart or pause it."""
    server = started_redis(RedisServer())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One private server for the whole session. Do not kill or pause it: use redis_server."""
    server = started_redis(RedisServer())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(shared_redis: RedisServer) -> str:
    """URL of the session's private server, emptied (FLUSHALL) before the test."""
    if not shared_redis.running:
        # A test broke the rule above; bring the server back so later tests are unaffected.
        started_redis(shared_redis)
    shared_redis.resume()
    shared_redis.cli("FLUSHALL")  # only ever our own port, never the shared 6379 server
    return shared_redis.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """One 3-master cluster for the session (``.url`` is spendguard's redis+cluster:// URL)."""
    cluster = started_cluster(RedisCluster())
    try:
        yield cluster
    finally:
        cluster.stop()
