"""Instructions per inference: what spendguard adds to a gateway, counted, not timed.

The HTTP ratios and the CPU per request move with the host by more than a change to the
request path is worth: on a shared VM the same gateway's CPU per inference moves by tens of
percent within minutes. An instruction count does not. Each variant of the example gateway
(``benchmarks/apps.py``) runs in process under valgrind's callgrind, twice: the same warm-up,
then ``--requests`` more inferences in the second run than in the first, 16 in flight. The
difference in instructions between the two runs, divided by that number, is what one inference
costs, start-up and warm-up cancelled out. Everything the process runs counts: the gateway, the
fake provider, spendguard, its record writer (records are flushed before the count ends) and
the garbage collector. Redis and PostgreSQL run in their own processes and are not counted.

Instructions are not time: a cache miss costs more than an add, and a gateway serving real
traffic walks more memory than this loop. So the ratio below is what the throughput ratio would
be if every instruction cost the same; the HTTP section measures the real one. Nor is the count
exact: what is batched (records written together, Redis calls sent in one pipeline) depends on
timing, so the stores' counts move by about 1 % of the whole between runs (their Redis counts
by up to 50,000 per inference), and the bare app's by well under 1 %. Its use is a before/after
comparison of the request path that the host's drift cannot blur:

    python -m benchmarks.instructions                 # bare, embedded, redis; both routes
    python -m benchmarks.instructions --variants embedded --routes inference
    python -m benchmarks.instructions --features      # section 6's gateways, one at a time

``--features`` counts section 6's gateways instead (``benchmarks/features.py``: spend limits
alone, budgets, everything; ``--configs`` picks others of its configurations), one request at
a time as section 6 runs them, on one redis-server (``--cluster``: a 3-master Cluster as
well): the CPU ratio of a feature to spend limits alone, free of the host's drift.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``), ``redis-server`` and PostgreSQL as
the rest of the suite; a run takes a few minutes (the process runs about fifty times slower).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Final

from .apps import build_gateway
from .asgi import drive, lifespan
from .common import Services, bench_identity, find_guard, set_policies
from .inprocess import inference_call, variant_settings
from .services import PrivatePostgres, PrivateRedis, ServiceError

VARIANTS: Final = ("bare", "embedded", "redis")
FEATURES_PREFIX: Final = "features:"  # a section 6 configuration, counted (``--features``)
FEATURE_CONFIGS: Final = ("spend limits", "budgets", "everything")
ROUTES: Final = ("inference", "stream")
WARM: Final = 200  # requests before the counted part, in both runs
BASE: Final = 200  # counted requests of the shorter run
CONCURRENCY: Final = 16
_COLLECTED = re.compile(r"Collected : (\d+)")


async def _serve(variant: str, route: str, requests: int, services: Services) -> None:
    """The child: the gateway in process, WARM + requests inferences, records flushed."""
    if variant.startswith(FEATURES_PREFIX):
        await _serve_features(variant.removeprefix(FEATURES_PREFIX), requests, services)
        return
    if variant == "embedded":
        # A SQLite file of its own: the two runs of a variant go side by side.
        services.workdir.mkdir(parents=True, exist_ok=True)
        await set_policies(services.sqlite_url, bench_identity())
    app = build_gateway(variant, settings=variant_settings(variant, services))
    call = inference_call(app, stream=route == "stream")
    async with lifespan(app):
        guard = find_guard(app)
        for n in (WARM, requests):
            await drive(call, CONCURRENCY, n)
            if guard is not None:
                await guard.recorder.flush()


async def _serve_features(config: str, requests: int, services: Services) -> None:
    """A section 6 gateway (``benchmarks/features.py``), warmed as there, then WARM + requests
    inferences one at a time; its records flushed after each part."""
    from .common import Sizes
    from .features import _prepared

    async with AsyncExitStack() as stack:
        # A key prefix of its own: the two runs of a configuration go side by side, and every
        # process names its team alike.
        prefix = f"instr-{uuid.uuid4().hex[:12]}"
        call, app = await _prepared(
            stack, services.redis_url, services.postgres_url, config, Sizes.quick(), prefix
        )
        guard = find_guard(app)
        assert guard is not None
        for n in (WARM, requests):
            for _ in range(n):
                status, _ = await call()
                if status != 200:
                    raise RuntimeError(f"{config}: a request answered {status}")
            await guard.recorder.flush()


def _count(variant: str, route: str, requests: int, services: Services, env: dict[str, str]) -> int:
    """Instructions of one child run under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        child = [variant, route, requests, services.redis_url, services.postgres_url]
        child.append(str(services.workdir / f"{variant}-{route}-{requests}"))
        args = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--child",
            json.dumps(child),
        ]
        done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
        found = _COLLECTED.search(done.stderr)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"{variant}/{route} under callgrind failed:\n{done.stderr[-2000:]}")
        return int(found.group(1))


def measure(
    services: Services, variants: tuple[str, ...], routes: tuple[str, ...], requests: int
) -> dict[str, dict[str, float]]:
    """Instructions per inference, by route and variant."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path.cwd()), env.get("PYTHONPATH")]))
    # Fifty times slower under callgrind: Redis answers must not look late.
    env["SPENDGUARD_REDIS_TIMEOUT"] = "30"
    # The same dict and set layouts in every run (string hashes are seeded per process).
    env["PYTHONHASHSEED"] = "0"
    out: dict[str, dict[str, float]] = {}
    # Two at a time: the runs are independent and their counts do not depend on the timing.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for route in routes:
            for variant in variants:
                short, long = pool.map(
                    lambda n, v=variant, r=route: _count(v, r, n, services, env),
                    (BASE, BASE + requests),
                )
                out.setdefault(route, {})[variant] = (long - short) / requests
    return out


def report(counts: dict[str, dict[str, float]]) -> str:
    lines = [
        "| route | variant | instructions per inference | added to bare | bare / variant |",
        "|---|---|---|---|---|",
    ]
    for route, by_variant in counts.items():
        bare = by_variant.get("bare")
        for variant, n in by_variant.items():
            added = "" if bare is None or variant == "bare" else f"{n - bare:,.0f}"
            ratio = "" if bare is None or variant == "bare" else f"{bare / n:.3f}"
            lines.append(f"| {route} | {variant} | {n:,.0f} | {added} | {ratio} |")
    return "\n".join(lines)


def features_report(counts: dict[str, dict[str, float]]) -> str:
    """``--features``: instructions per inference by Redis and configuration, as a multiple
    of spend limits alone on the same Redis."""
    lines = [
        "| Redis | configuration | instructions per inference | × spend limits alone |",
        "|---|---|---|---|",
    ]
    for redis, by_config in counts.items():
        base = by_config.get("spend limits")
        for config, n in by_config.items():
            ratio = "" if base is None else f"{n / base:.3f}×"
            lines.append(f"| {redis} | {config} | {n:,.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--requests", type=int, default=800, help="counted inferences (diff)")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--features", action="store_true", help="section 6's gateways")
    parser.add_argument("--configs", default=",".join(FEATURE_CONFIGS))
    parser.add_argument("--cluster", action="store_true", help="--features on a Cluster too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, route, n, redis_url, pg_url, workdir = json.loads(args.child)
        asyncio.run(_serve(variant, route, n, Services(redis_url, pg_url, Path(workdir))))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    if args.features:
        return _features_main(args)
    variants = tuple(v for v in args.variants.split(",") if v)
    routes = tuple(r for r in args.routes.split(",") if r)
    if unknown := (set(variants) - set(VARIANTS)) | (set(routes) - set(ROUTES)):
        parser.error(f"unknown variant or route: {', '.join(sorted(unknown))}")
    try:
        with (
            tempfile.TemporaryDirectory(prefix="spendguard-instr-") as tmp,
            PrivateRedis() as redis,
            PrivatePostgres(args.postgres_url) as pg,
        ):
            services = Services(redis.url, pg.url, Path(tmp))
            asyncio.run(set_policies(services.postgres_url, bench_identity()))
            counts = measure(services, variants, routes, args.requests)
    except ServiceError as exc:
        print(f"benchmark services unavailable: {exc}", file=sys.stderr)
        return 2
    print(report(counts))
    return 0


def _features_main(args: argparse.Namespace) -> int:
    from tests.support import RedisCluster

    from .features import SETS

    configs = tuple(c for c in args.configs.split(",") if c)
    if unknown := set(configs) - set(SETS):
        print(f"unknown configuration: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    variants = tuple(FEATURES_PREFIX + c for c in configs)
    counts: dict[str, dict[str, float]] = {}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="spendguard-instr-") as tmp,
            PrivateRedis() as redis,
            PrivatePostgres(args.postgres_url) as pg,
            RedisCluster() if args.cluster else contextlib.nullcontext() as cluster,
        ):
            servers = [("one redis-server", redis.url)]
            if cluster is not None:
                servers.append(("3-master Cluster", cluster.url))
            for name, url in servers:
                services = Services(url, pg.url, Path(tmp))
                got = measure(services, variants, ("inference",), args.requests)["inference"]
                counts[name] = {v.removeprefix(FEATURES_PREFIX): n for v, n in got.items()}
    except ServiceError as exc:
        print(f"benchmark services unavailable: {exc}", file=sys.stderr)
        return 2
    print(features_report(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
