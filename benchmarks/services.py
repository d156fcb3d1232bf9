"""The services a benchmark run owns: a private redis-server, a private PostgreSQL database and
uvicorn gateway processes, all on loopback and all removed at the end.

A machine's shared Redis and its existing databases are never touched: the Redis server is a
child process on a free port, and the database is created for the run and dropped after it.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from tests.support import (
    HOST,
    RedisServer,
    RedisServerError,
    TemporaryDatabase,
    clean_env,
    free_port,
    redis_version,
    uvicorn,
)


class ServiceError(RuntimeError):
    """A service the benchmarks need is missing or would not start."""


class PrivateRedis(RedisServer):
    """A ``redis-server`` child on a free loopback port, persisting nothing (the tests'
    launcher; it never touches a machine's shared Redis)."""

    def start(self) -> Self:
        try:
            return super().start()
        except RedisServerError as exc:
            raise ServiceError(f"redis-server did not start: {exc}") from exc

    def version(self) -> str:
        return redis_version()


class PrivatePostgres(TemporaryDatabase):
    """A database of its own (``spendguard_bench_<random>``) on an existing server, dropped at
    the end with ``WITH (FORCE)`` so a gateway still connected cannot keep it alive."""

    def __init__(self, admin_url: str | None = None) -> None:
        super().__init__(admin_url, prefix="spendguard_bench")

    def create(self) -> Self:
        try:
            return super().create()
        except Exception as exc:
            raise ServiceError(f"PostgreSQL is not reachable at {self.admin_url}: {exc}") from exc


class GatewayServer:
    """``uvicorn benchmarks.apps:create_app --factory`` (one worker) for one variant."""

    def __init__(self, variant: str, env: Mapping[str, str], log_dir: Path) -> None:
        self.variant = variant
        self.port = free_port()
        self._env = dict(env)
        self._log_path = log_dir / f"uvicorn-{variant}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Self:
        env = clean_env(**self._env, BENCH_GATEWAY_VARIANT=self.variant)
        self._proc = uvicorn(
            "benchmarks.apps:create_app",
            self.port,
            env,
            self._log_path,
            "--factory",
            "--host",
            HOST,
            "--workers",
            "1",
            # Logging every request would be the same cost for every variant, and is not what
            # a production gateway measures its limiter against.
            "--no-access-log",
            "--log-level",
            "warning",
        )
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise ServiceError(f"gateway {self.variant} exited:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((HOST, self.port), timeout=0.5) as sock,
            ):
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: bench\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
            time.sleep(0.05)
        raise ServiceError(f"gateway {self.variant} not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        if not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # graceful: the lifespan flushes its records
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None
