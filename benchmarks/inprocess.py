"""1. In-process overhead: raw ASGI calls, no sockets.

The bare gateway and the same gateway with spendguard (embedded store, Redis store) and with
the peer limiter all run in one event loop, their lifespans started, caches warm. Variants take
turns in blocks, in an order that rotates every round, so drift (CPU frequency, GC, a noisy
neighbour) hits all of them alike. Each request is timed with ``perf_counter_ns`` around the
ASGI call: preflight, the proxied call to the fake provider, and postflight are all inside.

Between blocks, spendguard's background record writer is drained (untimed): it works off the
request path by design, and left alone it would bill its SQL writes to whichever variant
happens to be timed next. Its cost shows up where it belongs, in the HTTP throughput runs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from spendguard import Settings
from spendguard.settings import load_settings

from .apps import HEALTH_PATH, INFERENCE_PATH, TOKEN, VARIANTS, build_gateway, chat_body
from .asgi import Call, http_scope, lifespan
from .common import Services, Sizes, bench_identity, find_guard, set_policies
from .stats import percentile, summary

ROUTES = ("inference", "health")


def _settings(variant: str, services: Services) -> Settings | None:
    # The settlement worker is left to section 4 (and to its own process in production at
    # scale): here its passes would land in whichever variant is being timed.
    if variant == "embedded":
        return load_settings(database_url=services.sqlite_url, run_worker=False)
    if variant == "redis":
        return load_settings(
            database_url=services.postgres_url, redis_url=services.redis_url, run_worker=False
        )
    return None


def _calls(app: Any) -> dict[str, Call]:
    auth = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"host", b"gateway")]
    body = chat_body()
    return {
        "inference": Call(
            app,
            http_scope(
                "POST", INFERENCE_PATH, [*auth, (b"content-type", b"application/json")], body
            ),
            body,
        ),
        "health": Call(app, http_scope("GET", HEALTH_PATH, auth)),
    }


async def _timed_block(call: Call, n: int, out: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        status = await call()
        out.append(clock() - start)
        if status != 200:
            raise RuntimeError(f"benchmark request answered {status}")


async def measure(
    services: Services, sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    identity = bench_identity()
    await set_policies(services.sqlite_url, identity)
    await set_policies(services.postgres_url, identity)
    per_repeat: list[dict[str, dict[str, list[int]]]] = []
    async with AsyncExitStack() as stack:
        apps = {
            v: build_gateway(v, settings=_settings(v, services), redis_url=services.redis_url)
            for v in VARIANTS
        }
        for app in apps.values():
            await stack.enter_async_context(lifespan(app))
        guards = {v: find_guard(app) for v, app in apps.items()}
        calls = {v: _calls(app) for v, app in apps.items()}

        async def drain() -> None:
            for guard in guards.values():
                if guard is not None:
                    await guard.recorder.flush()

        # Warm-up: connections, script registration, policy and usage caches, code paths.
        for v in VARIANTS:
            for route in ROUTES:
                await _timed_block(calls[v][route], sizes.inproc_warmup, [])
        await drain()

        for rep in range(repeats):
            progress(f"in-process: repeat {rep + 1}/{repeats}")
            samples: dict[str, dict[str, list[int]]] = {
                r: {v: [] for v in VARIANTS} for r in ROUTES
            }
            for route, total in (
                ("inference", sizes.inproc_inference),
                ("health", sizes.inproc_health),
            ):
                block = sizes.inproc_block if route == "inference" else sizes.inproc_block * 4
                rounds = max(1, total // block)
                gc.collect()
                for i in range(rounds):
                    order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
                    for v in order:
                        await _timed_block(calls[v][route], block, samples[route][v])
                        await drain()
            per_repeat.append(samples)
    return _report(per_repeat)


def _report(per_repeat: list[dict[str, dict[str, list[int]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"routes": {}}
    for route in ROUTES:
        variants: dict[str, Any] = {}
        for v in VARIANTS:
            p50s, p99s, added50, added99, ratio50, ratio99 = [], [], [], [], [], []
            for samples in per_repeat:
                mine, bare = samples[route][v], samples[route]["bare"]
                p50, p99 = percentile(mine, 50) / 1000, percentile(mine, 99) / 1000
                b50, b99 = percentile(bare, 50) / 1000, percentile(bare, 99) / 1000
                p50s.append(p50)
                p99s.append(p99)
                added50.append(p50 - b50)
                added99.append(p99 - b99)
                ratio50.append(p50 / b50)
                ratio99.append(p99 / b99)
            variants[v] = {
                "requests": len(per_repeat[0][route][v]),
                "p50_us": summary(p50s),
                "p99_us": summary(p99s),
                "added_p50_us": summary(added50),
                "added_p99_us": summary(added99),
                "p50_ratio": summary(ratio50),
                "p99_ratio": summary(ratio99),
            }
        out["routes"][route] = variants
    return out
