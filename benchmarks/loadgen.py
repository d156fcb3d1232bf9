"""Load from a separate process: ``wrk`` where installed, else this bounded asyncio client.

Run as a module, it is the fallback load generator (and the only one for bursts)::

    python -m benchmarks.loadgen run   --url URL [--method POST --body-file F] -H 'k: v' \
        --concurrency 64 --duration 1.0
    python -m benchmarks.loadgen burst --url URL --body-file F -H 'k: v' -n 500
    python -m benchmarks.loadgen serve   # one JSON job per stdin line, one result per line

The benchmark runner keeps one ``serve`` process for the whole run (a fresh interpreter per
load run would cost more than a short run itself).

``run`` keeps ``concurrency`` keep-alive connections busy for ``duration`` seconds (closed
loop, like wrk) and prints one JSON line: requests, requests/s, p50/p99 latency in µs and the
status counts. ``burst`` opens ``n`` connections first, then sends one request on each at the
same moment and prints the status counts: ``n`` requests truly in flight together.

Both are bounded: a run stops at its deadline (in-flight requests get ``timeout`` seconds to
finish), and every connection, read and write has a timeout, so a stuck server fails the run
instead of hanging it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .stats import percentile

TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    requests: int
    seconds: float
    p50_us: float
    p99_us: float
    statuses: dict[str, int]
    errors: int
    tool: str

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.startswith("2"))


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    method: str = "GET"
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


# ---------------------------------------------------------------------------------------------
# The asyncio client


def _request_bytes(target: Target) -> bytes:
    parts = urlsplit(target.url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    lines = [f"{target.method} {path} HTTP/1.1", f"host: {parts.netloc}"]
    lines += [f"{k}: {v}" for k, v in target.headers]
    if target.body or target.method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(target.body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + target.body


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one whole response (Content-Length or chunked) and return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    length: int | None = None
    chunked = False
    for line in header_block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                break
            await reader.readexactly(size + 2)
    elif length:
        await reader.readexactly(length)
    return status


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


async def _run(target: Target, concurrency: int, duration: float) -> LoadResult:
    host, port = _host_port(target.url)
    payload = _request_bytes(target)
    latencies: list[int] = []
    statuses: Counter[int] = Counter()
    errors = 0
    conns = [
        await asyncio.wait_for(asyncio.open_connection(host, port), TIMEOUT)
        for _ in range(concurrency)
    ]
    start = time.perf_counter()
    deadline = start + duration
    clock = time.perf_counter_ns

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            t = clock()
            writer.write(payload)
            try:
                status = await asyncio.wait_for(_read_response(reader), TIMEOUT)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                errors += 1
                return  # the connection is in an unknown state: stop using it
            latencies.append(clock() - t)
            statuses[status] += 1

    await asyncio.gather(*(worker(r, w) for r, w in conns))
    elapsed = time.perf_counter() - start
    for _, w in conns:
        w.close()
    return LoadResult(
        requests=len(latencies),
        seconds=elapsed,
        p50_us=percentile(latencies, 50) / 1000 if latencies else math.nan,
        p99_us=percentile(latencies, 99) / 1000 if latencies else math.nan,
        statuses={str(k): v for k, v in sorted(statuses.items())},
        errors=errors,
        tool="asyncio",
    )


async def _burst(target: Target, n: int) -> dict[str, int]:
    host, port = _host_port(target.url)
    payload = _request_bytes(target)
    conns = await asyncio.gather(
        *(asyncio.wait_for(asyncio.open_connection(host, port), TIMEOUT) for _ in range(n))
    )
    go = asyncio.Event()
    statuses: Counter[str] = Counter()

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await go.wait()
        writer.write(payload)
        try:
            statuses[str(await asyncio.wait_for(_read_response(reader), TIMEOUT * 3))] += 1
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            statuses["error"] += 1
        finally:
            writer.close()

    tasks = [asyncio.create_task(one(r, w)) for r, w in conns]
    await asyncio.sleep(0)  # every task is parked on the event: release them together
    go.set()
    await asyncio.gather(*tasks)
    return dict(sorted(statuses.items()))


# ---------------------------------------------------------------------------------------------
# wrk

_WRK_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}


def _wrk_time_us(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text.strip())
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _WRK_UNITS[match.group(2)]


def parse_wrk(output: str) -> LoadResult:
    """Parse ``wrk --latency`` output: requests, duration, p50/p99, non-2xx and socket errors."""
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", output)
    if done is None:
        raise ValueError(f"unexpected wrk output:\n{output}")
    requests = int(done.group(1))
    seconds = _wrk_time_us(done.group(2) + done.group(3)) / 1e6
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", output, re.MULTILINE))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    bad = int(non2xx.group(1)) if non2xx else 0
    socket = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    errors = sum(int(g) for g in socket.groups()) if socket else 0
    statuses = {"2xx": requests - bad}
    if bad:
        statuses["non-2xx"] = bad
    return LoadResult(
        requests=requests,
        seconds=seconds,
        p50_us=_wrk_time_us(pct["50"]) if "50" in pct else math.nan,
        p99_us=_wrk_time_us(pct["99"]) if "99" in pct else math.nan,
        statuses=statuses,
        errors=errors,
        tool="wrk",
    )


def _lua_string(value: str | bytes) -> str:
    text = value.decode() if isinstance(value, bytes) else value
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _wrk(target: Target, concurrency: int, duration: float) -> LoadResult:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(f"wrk.method = {_lua_string(target.method)}\n")
        if target.body:
            script.write(f"wrk.body = {_lua_string(target.body)}\n")
        for k, v in target.headers:
            script.write(f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}\n")
    try:
        # wrk counts durations in whole seconds; one thread is plenty for loopback load and
        # leaves the other core to the server.
        seconds = max(1, round(duration))
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{concurrency}",
                f"-d{seconds}s",
                "--timeout",
                f"{int(TIMEOUT)}s",
                "--latency",
                "-s",
                script.name,
                target.url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + TIMEOUT + 5,
            check=True,
        )
    finally:
        Path(script.name).unlink(missing_ok=True)
    return parse_wrk(out.stdout)


# ---------------------------------------------------------------------------------------------
# Running a load from the benchmark process


class _Worker:
    """One ``python -m benchmarks.loadgen serve`` process, started on first use."""

    proc: subprocess.Popen[str] | None = None

    @classmethod
    def ask(cls, job: dict[str, Any], timeout: float) -> Any:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.loadgen", "serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parent.parent,
            )
        assert cls.proc.stdin is not None and cls.proc.stdout is not None
        cls.proc.stdin.write(json.dumps(job) + "\n")
        cls.proc.stdin.flush()
        # The job is bounded by its own timeouts; this one only guards against a dead worker.
        line = _readline(cls.proc.stdout, timeout)
        if not line:
            cls.close()
            raise RuntimeError("the load generator process died")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"load generator failed: {answer['error']}")
        return answer

    @classmethod
    def close(cls) -> None:
        proc, cls.proc = cls.proc, None
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _readline(stream: Any, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no answer from the load generator in {timeout:.0f}s")
    line: str = stream.readline()
    return line


def close_worker() -> None:
    _Worker.close()


def _job(mode: str, target: Target, **params: Any) -> dict[str, Any]:
    return {
        "mode": mode,
        "url": target.url,
        "method": target.method,
        "body": target.body.decode("latin-1"),
        "headers": [list(h) for h in target.headers],
        **params,
    }


def run_load(
    target: Target, *, concurrency: int, duration: float, tool: str = "auto"
) -> LoadResult:
    """One closed-loop load run from a separate process (wrk, or this module)."""
    if tool == "wrk" or (tool == "auto" and have_wrk()):
        return _wrk(target, concurrency, duration)
    job = _job("run", target, concurrency=concurrency, duration=duration)
    return LoadResult(**_Worker.ask(job, duration + 4 * TIMEOUT))


def run_burst(target: Target, n: int) -> dict[str, int]:
    result: dict[str, int] = _Worker.ask(_job("burst", target, n=n), 6 * TIMEOUT)
    return result


def _result_dict(result: LoadResult) -> dict[str, Any]:
    return {
        "requests": result.requests,
        "seconds": result.seconds,
        "p50_us": result.p50_us,
        "p99_us": result.p99_us,
        "statuses": result.statuses,
        "errors": result.errors,
        "tool": result.tool,
    }


def _serve() -> None:
    for line in sys.stdin:
        try:
            job = json.loads(line)
            target = Target(
                job["url"],
                job["method"],
                job["body"].encode("latin-1"),
                tuple((k, v) for k, v in job["headers"]),
            )
            if job["mode"] == "run":
                duration = min(float(job["duration"]), 600.0)
                result = asyncio.run(_run(target, int(job["concurrency"]), duration))
                out: Any = _result_dict(result)
            else:
                out = asyncio.run(_burst(target, min(int(job["n"]), 5000)))
        except Exception as exc:  # reported to the runner, which fails the benchmark
            out = {"error": repr(exc)}
        print(json.dumps(out), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadgen")
    parser.add_argument("mode", choices=["run", "burst", "serve"])
    parser.add_argument("--url")
    parser.add_argument("--method", default="GET")
    parser.add_argument("--body-file")
    parser.add_argument("-H", "--header", action="append", default=[])
    parser.add_argument("-c", "--concurrency", type=int, default=1)
    parser.add_argument("-d", "--duration", type=float, default=1.0)
    parser.add_argument("-n", type=int, default=10)
    ns = parser.parse_args(argv)
    if ns.mode == "serve":
        _serve()
        return 0
    if not ns.url:
        parser.error("--url is required")
    headers = tuple((k.strip(), v.strip()) for k, _, v in (h.partition(":") for h in ns.header))
    body = Path(ns.body_file).read_bytes() if ns.body_file else b""
    target = Target(ns.url, ns.method.upper(), body, headers)
    if ns.mode == "run":
        out: Any = _result_dict(asyncio.run(_run(target, ns.concurrency, min(ns.duration, 600.0))))
    else:
        out = asyncio.run(_burst(target, min(ns.n, 5000)))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
