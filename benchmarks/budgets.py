"""Budgets on: the ``redis`` gateway variant with a budgets section (key, model and global scopes,
two windows, counted on Redis), against the same gateway without one, in process.

For a single redis-server and a 3-master Redis Cluster it reports, per inference at concurrency
1 on warm caches: the pipelines sent to Redis (sequential round trips: the spend limits'
preflight and postflight, the budgets' reserve and commit; on a cluster one pipeline reaches
every node it needs in parallel), and the p50 time to the last response byte with and without
budgets, whose difference is what budgets add.
"""

from __future__ import annotations

import time
from typing import Any

from spendguard import SpendGuardMiddleware
from spendguard.settings import load_settings
from tests.support import RedisCluster

from .apps import INFERENCE_PATH, MODEL, TOKEN, build_gateway, chat_body
from .asgi import Call, http_scope, lifespan
from .common import Services, Sizes, bench_identity, find_guard, set_policies
from .stats import percentile, summary

HIGH = 10**12  # never denies during a run
BUDGETS: dict[str, Any] = {
    "enabled": True,
    "storage": "redis",
    "windows": [{"id": "daily", "period": "24h"}, {"id": "monthly", "period": "30d"}],
    "scopes": {
        "per_api_key": {"tokens": HIGH, "cost_usd": 1_000_000},
        "per_model": {MODEL: {"tokens": HIGH}},
        "global": {"tokens": HIGH, "cost_usd": 1_000_000},
    },
}


def _middleware(app: Any) -> SpendGuardMiddleware:
    node: Any = getattr(app, "middleware_stack", None) or app
    while not isinstance(node, SpendGuardMiddleware):
        node = node.app
    return node


def _pipelines(app: Any) -> int:
    """Pipelines sent so far by the spend-limit store and the budget store."""
    guard = find_guard(app)
    assert guard is not None
    sent: int = guard.store.pipeline.stats.batches  # type: ignore[attr-defined]
    gate = _middleware(app).budgets
    if gate is not None and gate.redis is not None:
        sent += gate.redis.pipeline.stats.batches  # type: ignore[attr-defined]
    return sent


async def _run(redis_url: str, postgres_url: str, budgets: bool, sizes: Sizes) -> dict[str, float]:
    extra: dict[str, Any] = {"budgets": BUDGETS} if budgets else {}
    settings = load_settings(
        database_url=postgres_url,
        redis_url=redis_url,
        run_worker=False,
        redis_timeout=2.0,
        key_prefix="bench-budgets",
        **extra,
    )
    app = build_gateway("redis", settings=settings)
    auth = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-type", b"application/json")]
    body = chat_body()
    call = Call(app, http_scope("POST", INFERENCE_PATH, auth, body), body)
    n = max(50, sizes.inproc_inference // 4)
    async with lifespan(app):
        for _ in range(max(20, sizes.inproc_warmup // 4)):
            await call()
        before = _pipelines(app)
        times: list[int] = []
        for _ in range(n):
            start = time.perf_counter_ns()
            status, done = await call()
            if status != 200:
                raise RuntimeError(f"benchmark request answered {status}")
            times.append(done - start)
        sent = _pipelines(app) - before
    return {"p50_us": percentile(times, 50) / 1000, "pipelines_per_inference": sent / n}


async def measure(services: Services, sizes: Sizes, repeats: int) -> dict[str, Any]:
    await set_policies(services.postgres_url, bench_identity())
    out: dict[str, Any] = {}
    with RedisCluster() as cluster:
        for name, url in (("single", services.redis_url), ("cluster", cluster.url)):
            off: list[float] = []
            on: list[float] = []
            trips: dict[bool, float] = {}
            for _ in range(repeats):
                for budgets, into in ((False, off), (True, on)):
                    got = await _run(url, services.postgres_url, budgets, sizes)
                    into.append(got["p50_us"])
                    trips[budgets] = got["pipelines_per_inference"]
            out[name] = {
                "p50_us_budgets_off": summary(off),
                "p50_us_budgets_on": summary(on),
                "added_p50_us": summary([b - a for a, b in zip(off, on, strict=True)]),
                "pipelines_per_inference_budgets_off": trips[False],
                "pipelines_per_inference_budgets_on": trips[True],
            }
    return out
