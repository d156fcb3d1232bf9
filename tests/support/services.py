"""What a test does when a service it needs is missing: locally it skips, under ``CI=true`` it
FAILS, so CI can never go green by silently skipping the Redis or PostgreSQL tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from typing import NoReturn

import pytest

from .postgres import PG_ADMIN_URL, TemporaryDatabase
from .redis import RedisCluster, RedisServer, RedisServerError

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> NoReturn:
    if IN_CI:
        pytest.fail(f"required under CI=true: {reason}")
    pytest.skip(reason)


def require_redis_server() -> None:
    """For a test that builds its own RedisServer: the binaries must be on PATH."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not on PATH")


def require_modules(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            unavailable(f"{module} is not installed")


def require_loop(loop: str) -> None:
    """A test on ``loop`` (one of ``tests.support.loops.LOOPS``): uvloop must be importable,
    except on Windows, where it does not exist and its variants always skip."""
    if loop == "uvloop":
        if sys.platform == "win32":
            pytest.skip("uvloop does not run on Windows")
        require_modules("uvloop")


def started_redis(server: RedisServer) -> RedisServer:
    try:
        return server.start()
    except (RedisServerError, OSError) as exc:
        server.stop()
        unavailable(f"no usable redis-server: {exc}")


def started_cluster(cluster: RedisCluster) -> RedisCluster:
    try:
        return cluster.start()
    except (RedisServerError, OSError, subprocess.SubprocessError) as exc:
        cluster.stop()
        unavailable(f"no usable Redis cluster: {exc}")


def created_database(db: TemporaryDatabase) -> TemporaryDatabase:
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    try:
        return db.create()
    except (OSError, asyncpg.PostgresError) as exc:
        unavailable(f"no PostgreSQL server at {PG_ADMIN_URL}: {exc!r}")
