"""Real, private Redis servers on loopback for the Redis-store tests and the benchmarks.

Every server here is a ``redis-server`` child process on its own free 127.0.0.1 port with its
own temp dir. The machine's shared Redis on 6379 is never touched: nothing here connects to a
port it did not start a server on.

Cleanup is layered so that no process outlives the test run:

* fixtures stop their servers in ``finally`` blocks (also when a test fails);
* an ``atexit`` hook kills any child that is still alive when the interpreter exits;
* on Linux each child gets ``PR_SET_PDEATHSIG`` = SIGKILL (:func:`die_with_parent`), so even a
  SIGKILLed pytest (a CI timeout) does not leave servers holding ports.

The pytest fixtures built on these (``redis_url``, ``redis_server``, ``shared_redis``,
``redis_cluster``) are in ``tests/conftest.py``; the benchmarks start their server from here too.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from .ports import HOST, free_port
from .processes import die_with_parent

__all__ = ["RedisCluster", "RedisServer", "RedisServerError", "ping", "redis_version"]

START_TIMEOUT = 10.0
CLUSTER_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
CLI_TIMEOUT = 10.0
# An auto-picked port can be grabbed by another process between our probe and the server's
# bind(); a handful of fresh picks makes that race irrelevant.
PORT_ATTEMPTS = 5

# Every server that may still own a process or a temp dir, for the atexit backstop.
_LIVE: set[RedisServer] = set()
_LIVE_LOCK = threading.Lock()


class RedisServerError(RuntimeError):
    """A redis-server process could not be started (or a cluster could not be formed)."""


class _StoppedOnExit:
    """``with server:`` starts it if needed (each class's ``__enter__``) and stops it after."""

    def stop(self) -> None:
        raise NotImplementedError

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def ping(port: int, timeout: float = 0.5) -> bool:
    """True if a server on ``port`` answers PING (raw RESP, so no client library or fork)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(_StoppedOnExit):
    """One private ``redis-server`` process on 127.0.0.1 that persists nothing to disk."""

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        # port=None: pick a free port (and re-pick if it is lost to a race). An explicit port
        # is used as is and a clash is an error.
        self._auto_port = port is None
        self._port = port if port is not None else free_port()
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._paused = False

    # -- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return HOST

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self._port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the process exists (paused counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def directory(self) -> Path | None:
        """The server's working dir (log file ``redis.log``; nodes.conf for cluster nodes)."""
        return self._dir

    @property
    def log_path(self) -> Path | None:
        return self._dir / "redis.log" if self._dir is not None else None

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.running else "stopped")
        return f"<RedisServer {HOST}:{self._port} {state}>"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the process and wait (at most 10 s) until it answers PING."""
        if self.running:
            raise RedisServerError(f"{self!r} is already running")
        if shutil.which("redis-server") is None:
            raise RedisServerError("redis-server is not on PATH")
        attempts = PORT_ATTEMPTS if self._auto_port else 1
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except _PortInUse:
                if attempt + 1 == attempts:
                    raise RedisServerError(
                        f"port {self._port} is in use; redis-server could not bind it"
                    ) from None
                self._port = free_port()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Graceful stop (SIGTERM, SIGKILL after a timeout) and remove the temp dir."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            if self._paused:
                # A stopped process only acts on SIGTERM once it is continued.
                proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None
        self._paused = False
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL: a crash. All data is lost; the temp dir (log, nodes.conf) is kept."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()  # SIGKILL also ends a SIGSTOPped process
            proc.wait()
        self._proc = None
        self._paused = False

    def restart(self) -> Self:
        """Crash and start again on the SAME port: like a restart of a server with no
        persistence, every key is gone (clients see their connections drop)."""
        self.kill()
        self._auto_port = False  # clients hold the URL: the port must not move
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: a hung Redis. The kernel still accepts TCP connections, nothing answers."""
        if not self.running:
            raise RedisServerError(f"{self!r} is not running")
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT: the hung server answers again (queued commands are then processed)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT) -> str:
        """Run ``redis-cli`` against this server and return its stdout.

        Error replies come back as text (redis-cli exits 0 on them); a connection failure
        raises ``subprocess.CalledProcessError``, a hang ``subprocess.TimeoutExpired``.
        """
        done = subprocess.run(
            ["redis-cli", "-h", HOST, "-p", str(self._port), *args],
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, done.args, output=done.stdout, stderr=done.stderr
            )
        return done.stdout.decode()

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    # -- internals --------------------------------------------------------------------------

    def _command(self) -> list[str]:
        assert self._dir is not None
        return [
            "redis-server",
            "--port",
            str(self._port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self._dir),
            *self.extra_args,
        ]

    def _spawn_and_wait(self) -> None:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="spendguard-redis-"))
        with _LIVE_LOCK:
            _LIVE.add(self)
        log_path = self._dir / "redis.log"
        # Output goes to a file, not a pipe: nobody drains a pipe, and a full one would block
        # the server mid-test.
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                cwd=self._dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(),
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                text = log_path.read_text(errors="replace")
                if "Address already in use" in text:
                    log_path.unlink(missing_ok=True)
                    raise _PortInUse
                raise RedisServerError(f"redis-server exited during startup:\n{text[-2000:]}")
            if ping(self._port):
                return
            time.sleep(0.02)
        self.kill()
        raise RedisServerError(
            f"redis-server on port {self._port} did not answer PING within {START_TIMEOUT} s:\n"
            + log_path.read_text(errors="replace")[-2000:]
        )


class _PortInUse(Exception):
    """Internal: the server could not bind its port (another process took it)."""


class RedisCluster(_StoppedOnExit):
    """Three cluster-enabled masters on loopback, slots 0-16383 spread over them."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 5000) -> None:
        self.servers: list[RedisServer] = []
        self._masters = masters
        self._node_timeout_ms = node_timeout_ms

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [(s.host, s.port) for s in self.servers]

    @property
    def url(self) -> str:
        """spendguard's own scheme; for redis-py use ``redis_py_url`` with RedisCluster."""
        return f"redis+cluster://{HOST}:{self.servers[0].port}"

    @property
    def redis_py_url(self) -> str:
        return f"redis://{HOST}:{self.servers[0].port}"

    def start(self) -> Self:
        try:
            for _ in range(self._masters):
                node = RedisServer(
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(self._node_timeout_ms),
                        # The bus port defaults to port+10000, which may be taken or > 65535
                        # for a high ephemeral port; pin it to a port we know was free.
                        "--cluster-port",
                        str(free_port()),
                    ]
                )
                self.servers.append(node)
                node.start()
            create = subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"{h}:{p}" for h, p in self.nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                timeout=CLUSTER_TIMEOUT,
                check=False,
            )
            if create.returncode != 0:
                raise RedisServerError(
                    "redis-cli --cluster create failed:\n"
                    + (create.stdout + create.stderr).decode(errors="replace")[-2000:]
                )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self) -> None:
        # "create" returns once slots are assigned; each node still has to learn the others'
        # slots via gossip before it serves the whole key space.
        deadline = time.monotonic() + CLUSTER_TIMEOUT
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in self.servers):
                return
            time.sleep(0.05)
        raise RedisServerError(f"cluster not ok after {CLUSTER_TIMEOUT} s")

    def stop(self) -> None:
        for node in self.servers:
            node.stop()
        self.servers = []

    def slot_of(self, key: str) -> int:
        return int(self.servers[0].cli("CLUSTER", "KEYSLOT", key).strip())

    def flushall(self) -> None:
        """Empty every master (each holds only its own slots)."""
        for node in self.servers:
            node.cli("FLUSHALL")

    def __enter__(self) -> Self:
        if not self.servers:
            self.start()
        return self


@atexit.register
def _kill_leftovers() -> None:
    """Backstop for anything a fixture could not stop (an interrupted session, a bug)."""
    with _LIVE_LOCK:
        leftovers = list(_LIVE)
    for server in leftovers:
        with contextlib.suppress(Exception):
            server.kill()
            server.stop()


def redis_version() -> str:
    """The version of the ``redis-server`` on PATH (``7.2.4``), or its raw ``--version`` text."""
    exe = shutil.which("redis-server") or "redis-server"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    for part in out.stdout.split():
        if part.startswith("v="):
            return part[2:]
    return out.stdout.strip()
