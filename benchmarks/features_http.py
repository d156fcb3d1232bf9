"""Section 6b: every request-path feature on, over HTTP at the highest concurrency.

Three uvicorn processes (one worker each) of the example gateway, taking turns as in section 2:
the bare app, spendguard on Redis with spend limits alone (the key's daily and the team's
monthly limit, as in section 2), and the same with everything section 6 turns on (the key's
limit hard, a prepaid balance, model lists on the key and the team, rates on both, budgets for
the key, the model and the fleet, remaining-spend headers, a provider key leased from declared
candidates), all far above what a run uses. Each spendguard server has a database and a key
prefix of its own; their settings come from the environment only (``SPENDGUARD_BUDGETS``,
``SPENDGUARD_PROVIDER_CANDIDATES``, ``SPENDGUARD_PROVIDER_KEYS``, ...), as a deployment's would.

Reported per server: requests/s (2xx only) and its ratio to the bare app's in the same round,
and the server process's CPU per request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spendguard import SpendGuard
from spendguard.settings import load_settings

from .apps import MODEL
from .common import HIGH_LIMIT_MICROS, Sizes, bench_identity, section_args, set_policies
from .features import BUDGETS
from .http_load import _cpu_seconds, target
from .loadgen import run_load
from .services import GatewayServer, PrivatePostgres
from .stats import summary

CONFIGS = ("bare", "spend limits", "everything")
POOL_KEY = "bench-upstream"


async def _everything(database_url: str) -> None:
    """The policies of section 6's "everything", written to the ledger the server reads."""
    identity = bench_identity()
    await set_policies(database_url, identity, hard=True)
    guard = SpendGuard(load_settings(database_url=database_url, run_worker=False))
    await guard.start(worker=False)
    try:
        admin, team, key = guard.admin, identity.team_id, identity.api_key_id
        await admin.topup(team, HIGH_LIMIT_MICROS // 10**6)
        await admin.allow_models(team, key, [f"{MODEL}*"])
        await admin.allow_models(team, None, ["gpt-*", "claude-*"])
        for k in (key, None):
            await admin.set_rates(team, k, rpm=10**9, tpm=10**12, max_parallel=10**6)
    finally:
        await guard.stop()


def _env(config: str, redis_url: str, database_url: str) -> dict[str, str]:
    env = {
        "SPENDGUARD_DATABASE_URL": database_url,
        "SPENDGUARD_REDIS_URL": redis_url,
        "SPENDGUARD_RUN_WORKER": "false",
        "SPENDGUARD_KEY_PREFIX": "b6" + config[0],
    }
    if config == "everything":
        env |= {
            "SPENDGUARD_BUDGETS": json.dumps(BUDGETS),
            "SPENDGUARD_REMAINING_HEADERS": "true",
            "SPENDGUARD_PROVIDER_CANDIDATES": json.dumps({"*": [POOL_KEY]}),
            "SPENDGUARD_PROVIDER_KEYS": json.dumps(
                [{"id": POOL_KEY, "provider": "openai", "tpm": 10**12, "rpm": 10**9}]
            ),
        }
    return env


def measure(
    redis_url: str,
    postgres_admin_url: str,
    workdir: Path,
    sizes: Sizes,
    repeats: int,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    conc = max(sizes.http_concurrency)
    runs: dict[str, list[tuple[float, float, int]]] = {c: [] for c in CONFIGS}
    with (
        PrivatePostgres(postgres_admin_url) as pg_spend,
        PrivatePostgres(postgres_admin_url) as pg_all,
    ):
        asyncio.run(set_policies(pg_spend.url, bench_identity()))
        asyncio.run(_everything(pg_all.url))
        servers: dict[str, GatewayServer] = {}
        try:
            for config, db in (
                ("bare", ""),
                ("spend limits", pg_spend.url),
                ("everything", pg_all.url),
            ):
                logs = workdir / f"6b-{config.replace(' ', '-')}"
                logs.mkdir(parents=True, exist_ok=True)
                variant, env = (
                    ("bare", {}) if config == "bare" else ("redis", _env(config, redis_url, db))
                )
                servers[config] = GatewayServer(variant, env, logs).start()
            for server in servers.values():
                server.wait_ready()
            for config, server in servers.items():  # connections, caches, code paths
                got = run_load(
                    target("inference", server.base),
                    concurrency=conc,
                    duration=max(sizes.http_warmup, 0.3),
                    tool="asyncio",
                )
                if got.ok == 0:
                    raise RuntimeError(f"section 6b: {config} answered no request ({got.statuses})")
            for rep in range(repeats + 2):
                progress(f"6b. HTTP, everything on: round {rep + 1}")
                order = CONFIGS[rep % 3 :] + CONFIGS[: rep % 3]
                for config in order:
                    server = servers[config]
                    cpu0 = _cpu_seconds(server.pid)
                    result = run_load(
                        target("inference", server.base),
                        concurrency=conc,
                        duration=sizes.http_seconds,
                    )
                    cpu = _cpu_seconds(server.pid) - cpu0
                    bad = sum(
                        n for status, n in result.statuses.items() if not 200 <= int(status) < 300
                    )
                    runs[config].append(
                        (result.ok / result.seconds, cpu / max(result.requests, 1), bad)
                    )
                    time.sleep(sizes.http_pause)
        finally:
            for server in servers.values():
                server.stop()
    out: dict[str, Any] = {"concurrency": conc}
    bare = [r[0] for r in runs["bare"]]
    for config in CONFIGS:
        mine = runs[config]
        out[config] = {
            "rps": summary([r[0] for r in mine]),
            "x_bare": summary([r[0] / b for r, b in zip(mine, bare, strict=True)]),
            "cpu_us_per_request": summary([r[1] * 1e6 for r in mine]),
            "non_2xx": sum(r[2] for r in mine),
        }
    return out


def section(results: dict[str, Any]) -> list[str]:
    from .report import _cell, _table

    lines = [
        "## 6b. HTTP, every feature on (uvicorn, one worker, concurrency "
        f"{results['concurrency']})",
        "",
        "requests/s count 2xx answers only; × bare is taken round by round; CPU is the server "
        "process's per request.",
        "",
    ]
    rows = [
        [
            config,
            _cell(results[config]["rps"]),
            _cell(results[config]["x_bare"], 2),
            _cell(results[config]["cpu_us_per_request"]),
            str(results[config]["non_2xx"]),
        ]
        for config in CONFIGS
    ]
    return lines + _table(["configuration", "req/s", "× bare", "CPU µs/req", "non-2xx"], rows)


def main() -> None:
    """``python -m benchmarks.features_http [--quick] [--repeat N]``: section 6b alone."""
    import tempfile
    from contextlib import ExitStack

    from .loadgen import close_worker
    from .services import PrivateRedis

    args = section_args("python -m benchmarks.features_http")
    sizes = Sizes.quick() if args.quick else Sizes.full()
    with ExitStack() as stack:
        stack.callback(close_worker)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sg-6b-")))
        redis = stack.enter_context(PrivateRedis())
        results = measure(redis.url, args.postgres_url, workdir, sizes, args.repeat)
    print("\n".join(section(results)))


if __name__ == "__main__":
    main()
