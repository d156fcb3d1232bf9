"""Tests for spendguard.engine.embedded: one process runs the embedded store on a ledger.

Guards of one process share the claim; a guard in another process is refused at start, with
the pid of the process that holds it; the claim goes with its process, however it ends.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from spendguard import ConfigurationError, Identity, Settings, SpendGuard
from spendguard.engine.decision import Unavailable, Verdict
from spendguard.engine.embedded import lock_path
from spendguard.store.memory import MemoryStore
from tests.support import ROOT, Clock, Gateway, clean_env, die_with_parent, write_unit_prices

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")

# Another process running the embedded store on the database given as its argument.
HOLDER = """
import sys, anyio
from spendguard import Settings, SpendGuard

async def main() -> None:
    async with SpendGuard(Settings(database_url=sys.argv[1])):
        print("started", flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


def sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


def guard(tmp_path: Path, url: str | None = None) -> SpendGuard:
    settings = Settings(database_url=url or sqlite(tmp_path), prices=write_unit_prices(tmp_path))
    clock = Clock()
    return SpendGuard(settings, store=MemoryStore(clock=clock), clock=clock)


def locked(tmp_path: Path) -> bool:
    """Whether some open file (of any process, this one included) holds the claim."""
    with open(lock_path(str(tmp_path / "ledger.db")), "a+b") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def run_holder(tmp_path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, sqlite(tmp_path)],
        cwd=ROOT,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent(),
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            assert line == "started\n", (line, proc.stderr.read() if proc.stderr else "")
            return proc
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    proc.kill()
    raise AssertionError("the holder did not start")


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = run_holder(tmp_path)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)  # no shutdown: only the kernel releases its lock
    proc.wait(timeout=10)


async def test_guards_of_one_process_share_the_claim_until_the_last_stops(
    tmp_path: Path,
) -> None:
    first, second = guard(tmp_path), guard(tmp_path)
    await first.start(worker=False)
    await second.start(worker=False)
    for g in (first, second):
        assert (await g.preflight(ALPHA, g.clock())).verdict is Verdict.ALLOW
    assert locked(tmp_path)
    await second.stop()  # each guard's own task group: they stop in reverse order
    assert locked(tmp_path)  # the first guard still runs
    await first.stop()
    assert not locked(tmp_path)
    await first.start(worker=False)  # and the next start claims it again
    assert locked(tmp_path)
    await first.stop()
    assert not locked(tmp_path)


async def test_another_process_is_refused_until_the_holder_is_killed(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    g = guard(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        await g.start(worker=False)
    message = str(refused.value)
    assert f"another process (pid {holder.pid}) already runs it on the database" in message
    assert "embedded store (no SPENDGUARD_REDIS_URL) counts spend in this process only" in message
    assert "N workers would admit N times every limit" in message
    assert "Run one worker process, or set SPENDGUARD_REDIS_URL" in message
    assert not g.running
    # A host that serves on after the failed start gets no admission from this process's
    # counts, failing open or not.
    decision = await g.preflight(ALPHA, g.clock())
    assert decision.verdict is Verdict.UNAVAILABLE and decision.unavailable is Unavailable.STORE

    sigkill(holder)
    await g.start(worker=False)
    try:
        assert (await g.preflight(ALPHA, g.clock())).verdict is Verdict.ALLOW
    finally:
        await g.stop()
    assert not locked(tmp_path)


async def test_a_first_request_start_refused_answers_503(
    tmp_path: Path, holder: subprocess.Popen[str], caplog: pytest.LogCaptureFixture
) -> None:
    # No lifespan: the middleware starts the guard on the first inference request.
    gw = Gateway(tmp_path)
    with caplog.at_level(logging.ERROR, logger="spendguard"):
        for _ in range(3):
            assert (await gw.post()).status_code == 503
    assert not gw.guard.running
    assert f"another process (pid {holder.pid})" in caplog.text
    assert gw.store.calls["preflight"] == 0 and gw.ledger.calls["insert_records"] == 0


async def test_a_process_that_stopped_its_guards_lets_another_start(tmp_path: Path) -> None:
    g = guard(tmp_path)
    await g.start(worker=False)
    with anyio.fail_after(60):
        refused = await anyio.run_process(
            [sys.executable, "-c", HOLDER, sqlite(tmp_path)], cwd=ROOT, env=clean_env(), check=False
        )
    assert refused.returncode != 0
    assert f"another process (pid {os.getpid()})" in refused.stderr.decode()
    await g.stop()
    sigkill(await anyio.to_thread.run_sync(run_holder, tmp_path))


# A process whose forked child outlives its guard: the lock must go with the guard's stop.
FORKS = """
import fcntl, os, sys, anyio
from spendguard import Settings, SpendGuard
from spendguard.engine.embedded import lock_path

async def main() -> None:
    g = SpendGuard(Settings(database_url=sys.argv[1]))
    await g.start(worker=False)
    wait_r, wait_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # holds every descriptor the parent had at the fork
        os.write(ready_w, b"x")
        os.read(wait_r, 1)
        os._exit(0)
    assert os.read(ready_r, 1) == b"x"  # fork() returned in the child: its handlers ran
    await g.stop()
    with open(lock_path(sys.argv[2]), "a+b") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("released")
        except OSError:
            print("held by the child")
    os.write(wait_w, b"x")
    os.waitpid(pid, 0)

anyio.run(main)
"""


async def test_a_forked_child_does_not_keep_the_claim(tmp_path: Path) -> None:
    # In a child process of its own: forking the test process (its threads) is not safe.
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-c", FORKS, sqlite(tmp_path), str(tmp_path / "ledger.db")],
            cwd=ROOT,
            env=clean_env(),
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == "released\n"


async def test_a_postgres_ledger_warns_that_limits_count_per_process(
    tmp_path: Path, clean_postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    g = guard(tmp_path, clean_postgres_url)
    with caplog.at_level(logging.WARNING, logger="spendguard"):
        await g.start(worker=False)
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            "embedded store (no SPENDGUARD_REDIS_URL) with a PostgreSQL ledger" in m
            and "set SPENDGUARD_REDIS_URL" in m
            for m in warned
        ), caplog.text
    finally:
        await g.stop()
