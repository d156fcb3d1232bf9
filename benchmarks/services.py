"""The services a benchmark run owns: a private redis-server, a private PostgreSQL database and
uvicorn gateway processes, all on loopback and all removed at the end.

A machine's shared Redis and its existing databases are never touched: the Redis server is a
child process on a free port, and the database is created for the run and dropped after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


class ServiceError(RuntimeError):
    """A service the benchmarks need is missing or would not start."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that SIGKILLs the child if this process dies (Linux, main thread only), so a
    killed benchmark run never leaves servers holding ports."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _ping_redis(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class PrivateRedis:
    """A ``redis-server`` child on a free loopback port, persisting nothing."""

    def __init__(self) -> None:
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Self:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ServiceError("redis-server is not on PATH (install Redis)")
        self._dir = Path(tempfile.mkdtemp(prefix="spendguard-bench-redis-"))
        for _ in range(5):  # a free port can be taken between the probe and bind()
            self.port = free_port()
            log = (self._dir / "redis.log").open("ab")
            self._proc = subprocess.Popen(
                [
                    exe,
                    "--port",
                    str(self.port),
                    "--bind",
                    HOST,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self._dir),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(),
            )
            log.close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self._proc.poll() is None:
                if _ping_redis(self.port):
                    return self
                time.sleep(0.02)
            self._kill()
        raise ServiceError("redis-server did not start: " + self._log_tail())

    def version(self) -> str:
        exe = shutil.which("redis-server") or "redis-server"
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
        for part in out.stdout.split():
            if part.startswith("v="):
                return part[2:]
        return out.stdout.strip()

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        path = self._dir / "redis.log"
        return path.read_text(errors="replace")[-1000:] if path.exists() else ""

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._kill()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PrivatePostgres:
    """A database of its own (``spendguard_bench_<random>``) on an existing server, dropped at
    the end with ``WITH (FORCE)`` so a gateway still connected cannot keep it alive."""

    def __init__(self, admin_url: str | None = None) -> None:
        self.admin_url = admin_url or os.environ.get(
            "SPENDGUARD_TEST_POSTGRES_URL", DEFAULT_PG_ADMIN_URL
        )
        self.name = f"spendguard_bench_{uuid.uuid4().hex[:12]}"
        self.created = False
        self.server_version = ""

    @property
    def url(self) -> str:
        return f"{self.admin_url.rsplit('/', 1)[0]}/{self.name}"

    async def _admin(self, sql: str) -> str:
        import asyncpg  # type: ignore[import-untyped]

        conn = await asyncpg.connect(self.admin_url, timeout=5)
        try:
            await conn.execute(sql)
            return str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()

    def start(self) -> Self:
        try:
            self.server_version = asyncio.run(self._admin(f'CREATE DATABASE "{self.name}"'))
        except Exception as exc:
            raise ServiceError(f"PostgreSQL is not reachable at {self.admin_url}: {exc}") from exc
        self.created = True
        return self

    def stop(self) -> None:
        if self.created:
            asyncio.run(self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
            self.created = False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


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
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPENDGUARD_")}
        env.update(self._env)
        env["BENCH_GATEWAY_VARIANT"] = self.variant
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "benchmarks.apps:create_app",
                    "--factory",
                    "--host",
                    HOST,
                    "--port",
                    str(self.port),
                    "--workers",
                    "1",
                    # Logging every request would be the same cost for every variant, and is
                    # not what a production gateway measures its limiter against.
                    "--no-access-log",
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(),
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
