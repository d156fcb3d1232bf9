"""Run every benchmark in one go and write results.json, results.md and chart.png.

    python -m benchmarks.run [--quick] [--repeat N] [--out benchmarks/results]
                             [--loadgen auto|wrk|asyncio]

Needs ``redis-server`` on PATH and a PostgreSQL server (``SPENDGUARD_TEST_POSTGRES_URL``,
default ``postgresql://postgres@127.0.0.1:5432/postgres``), like the test suite. The run starts
its own Redis server and creates (and drops) its own databases; nothing else is touched.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from . import (
    alone,
    features,
    http_load,
    inprocess,
    overshoot,
    redis_path,
    report,
    routing,
    settlement,
)
from .apps import VARIANTS
from .common import Services, Sizes, bench_identity, set_policies
from .loadgen import close_worker, have_wrk, run_load
from .services import GatewayServer, PrivatePostgres, PrivateRedis, ServiceError

DEFAULT_OUT = Path("benchmarks") / "results"


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine(redis: PrivateRedis, pg: PrivatePostgres, tool: str) -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    mem_kb = next(
        (
            int(line.split()[1])
            for line in _read("/proc/meminfo").splitlines()
            if line.startswith("MemTotal:")
        ),
        0,
    )
    versions = {}
    for pkg in ("spendguard", "starlette", "fastapi", "uvicorn", "redis", "slowapi", "limits"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    if tool == "wrk":
        out = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
        loadgen = (out.stdout or out.stderr).split("[")[0].strip() or "wrk"
    else:
        loadgen = "asyncio load generator (benchmarks/loadgen.py)"
    info = {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "redis_server": redis.version(),
        "postgresql": pg.server_version,
        "load_generator": loadgen,
        "packages": versions,
        "load_average_at_start": list(os.getloadavg()),
    }
    info["summary"] = (
        f"{info['cores']} cores ({cpu}), {info['ram_gib']} GiB RAM, {platform.system()}, "
        f"Python {info['python']}, redis-server {info['redis_server']}, "
        f"PostgreSQL {info['postgresql']}, load from {loadgen}"
    )
    return info


def _gateway_env(variant: str, services: Services, http_sqlite: str) -> dict[str, str]:
    # The settlement worker runs in its own process in these runs (SPENDGUARD_RUN_WORKER=false,
    # the multi-process setup); section 4 measures settlement on its own.
    if variant == "embedded":
        return {"SPENDGUARD_DATABASE_URL": http_sqlite, "SPENDGUARD_RUN_WORKER": "false"}
    if variant == "redis":
        return {
            "SPENDGUARD_DATABASE_URL": services.postgres_url,
            "SPENDGUARD_REDIS_URL": services.redis_url,
            "SPENDGUARD_RUN_WORKER": "false",
        }
    if variant == "slowapi":
        return {"BENCH_REDIS_URL": services.redis_url}
    return {}


def _warm_servers(servers: dict[str, GatewayServer], sizes: Sizes) -> None:
    # Connections, pools, caches and code paths of every server, at the highest concurrency.
    # The asyncio generator takes sub-second runs (wrk counts whole seconds).
    if sizes.http_warmup <= 0:
        return
    conc = max(sizes.http_concurrency)
    for server in servers.values():
        for route in http_load.ROUTES:
            target = http_load.target(route, server.base)
            run_load(target, concurrency=conc, duration=sizes.http_warmup, tool="asyncio")


def run(args: argparse.Namespace) -> dict[str, Any]:
    progress = Progress()
    sizes = Sizes.quick() if args.quick else Sizes.full()
    if args.loadgen == "wrk" and not have_wrk():
        raise ServiceError("--loadgen wrk, but wrk is not installed")
    # auto: wrk where installed, unless the runs are shorter than the second wrk counts in.
    short = min(sizes.http_seconds, sizes.http_health_seconds) < 1
    auto_wrk = args.loadgen == "auto" and have_wrk() and not short
    tool = "wrk" if args.loadgen == "wrk" or auto_wrk else "asyncio"
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spendguard-bench-")))
        stack.callback(close_worker)
        progress("starting a private redis-server and PostgreSQL databases")
        redis = stack.enter_context(PrivateRedis())
        pg = stack.enter_context(PrivatePostgres(args.postgres_url))
        pg_settle = stack.enter_context(PrivatePostgres(args.postgres_url))
        services = Services(redis.url, pg.url, workdir)
        results["machine"] = machine(redis, pg, tool)

        progress("1. in-process overhead")
        results["inprocess"] = asyncio.run(
            inprocess.measure(services, sizes, args.repeat, progress)
        )

        progress("1b. spendguard alone")
        results["alone"] = asyncio.run(alone.measure(services, sizes, args.repeat))

        progress("1c. route matching and the safety net")
        routing_db = f"sqlite:///{workdir / 'routing.db'}"
        results["routing"] = asyncio.run(routing.measure(routing_db, sizes, args.repeat, progress))

        progress("2. HTTP: starting the gateways")
        http_sqlite = f"sqlite:///{workdir / 'http-embedded.db'}"
        asyncio.run(set_policies(http_sqlite, bench_identity()))
        servers: dict[str, GatewayServer] = {}
        for v in VARIANTS:
            server = GatewayServer(v, _gateway_env(v, services, http_sqlite), workdir)
            stack.callback(server.stop)
            servers[v] = server.start()
        for server in servers.values():
            server.wait_ready()
        _warm_servers(servers, sizes)
        results["http"] = http_load.measure(servers, sizes, args.repeat, tool, progress)

        progress("3. overshoot")
        results["overshoot"] = overshoot.measure(
            servers,
            {"embedded": http_sqlite, "redis": services.postgres_url},
            sizes,
            args.repeat,
            progress,
        )
        for server in servers.values():
            server.stop()

        progress("4. settlement")
        results["settlement"] = settlement.measure(
            f"sqlite:///{workdir / 'settle.db'}",
            pg_settle.url,
            redis.url,
            sizes,
            args.repeat,
            progress,
        )
        progress("Redis client path")
        results["redis_client_path"] = redis_path.measure(redis.url, sizes, args.repeat)
        progress("6. features on (single node and cluster)")
        results["features"] = asyncio.run(features.measure(services, sizes, args.repeat))
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
    results["peer"] = report.peer_rows(results)
    results["run"] = {
        "command": "python -m benchmarks.run" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "repeats": args.repeat,
        "sizes": dataclasses.asdict(sizes),
        "seconds": time.perf_counter() - progress.start,
        "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    results["targets"] = report.targets(results)
    return results


def write(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "chart.png"]
    paths[0].write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    paths[1].write_text(report.markdown(results) + "\n")
    report.chart(results, paths[2])
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (~20 s): a smoke run")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of every measurement")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "asyncio"],
        default="auto",
        help="HTTP load generator (auto: wrk if installed and the runs last 1 s or more, "
        "else the asyncio one)",
    )
    parser.add_argument("--postgres-url", default=None, help="admin URL of a PostgreSQL server")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if shutil.which("redis-server") is None:
        print("redis-server is not on PATH: install Redis", file=sys.stderr)
        return 2
    try:
        results = run(args)
    except ServiceError as exc:
        print(f"benchmark services unavailable: {exc}", file=sys.stderr)
        return 2
    for path in write(results, args.out):
        print(path)
    for t in results["targets"]:
        spread = "  (goal within the repeats' spread)" if t["within_spread"] else ""
        print(f"{'met   ' if t['met'] else 'MISSED'}  {t['target']}{spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
