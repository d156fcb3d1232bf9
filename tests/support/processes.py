"""Child processes of a test or a benchmark: gateways under uvicorn, the ``spendguard`` CLI,
and the environment they run in."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from .ports import free_port

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: where ``examples``, ``benchmarks`` and ``tests`` import from."""


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that SIGKILLs the child when this process dies, or None where unsafe.

    Even a SIGKILLed pytest (a CI timeout) or benchmark run then leaves no server holding a
    port. PDEATHSIG fires when the *thread* that forked exits, so it is only used from the
    main thread; a server started from a worker thread would otherwise die with that thread.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # resolved before fork: no dlopen in the child
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # parent already died before prctl took effect
            os._exit(1)

    return preexec


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any ``SPENDGUARD_*`` setting, plus ``overrides``;
    the repository root leads ``PYTHONPATH`` so children import ``examples`` and ``tests``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPENDGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(overrides)
    return env


def spawn(args: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python ARGS`` from the repository root, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )


def uvicorn(
    app: str, port: int, env: dict[str, str], log: Path, *options: str, loop: str | None = None
) -> subprocess.Popen[bytes]:
    """``python -m uvicorn APP --port PORT OPTIONS`` from the repository root, on the event
    loop ``loop`` (``--loop``; None: uvicorn's default, uvloop wherever it is installed)."""
    if loop is not None:
        options = ("--loop", loop, *options)
    return spawn(["-m", "uvicorn", app, "--port", str(port), *options], env, log)


def wait_healthy(
    base: str, proc: subprocess.Popen[bytes], log: Path, *, timeout: float = 20.0
) -> None:
    """Wait until ``base``/health answers 200; fail with the server's log if it exits or
    does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{base} did not come up:\n{log.read_text()}")
        time.sleep(0.1)


def stop(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM every process, then wait for each (graceful: a gateway flushes its records);
    one that does not exit in time is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_demo(env: dict[str, str], log: Path) -> Iterator[str]:
    """The demo gateway under uvicorn on a free port: yields its base URL once it answers,
    then stops it gracefully (for a pytest fixture: ``yield from serve_demo(env, log)``)."""
    port = free_port()
    proc = uvicorn("examples.gateway:app", port, env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield base
    finally:
        stop([proc], timeout=15)


def run_cli(env: dict[str, str], *args: str, timeout: float = 60.0) -> Any:
    """``spendguard ARGS --json`` as a separate process; its parsed output (exit 0 asserted)."""
    done = subprocess.run(
        [sys.executable, "-m", "spendguard.cli", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def call_cli(env: dict[str, str], *args: str) -> Any:
    """``spendguard ARGS --json`` in this process, as :func:`run_cli` would run it: the same
    ``main`` on ``env`` as the whole environment; its parsed output (exit 0 asserted).

    For a test's further CLI calls once its first one went through a real process: a process
    costs a second or two of imports each time and shows nothing more about the command."""
    from unittest import mock

    from spendguard.cli import main

    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, env, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main([*args, "--json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())
