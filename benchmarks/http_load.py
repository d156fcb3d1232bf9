"""2. HTTP throughput and latency: the gateway under uvicorn (one worker), load from another
process, concurrency 1, 16 and 64, for a non-inference route and for inference with and
without streaming.

All variants' servers run side by side for the whole section and take turns, in an order that
rotates every round, so machine drift hits all of them alike. Besides requests/s and latency,
each run reads the server process's CPU time (Linux ``/proc``): CPU per request is what a
limiter really costs, and it is far less sensitive than requests/s to other load on the box.

Throughput counts 2xx answers only: a 503 is cheaper than a proxied inference and must not
flatter a variant. Non-2xx answers are reported next to it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from .apps import HEALTH_PATH, INFERENCE_PATH, TOKEN, VARIANTS, chat_body
from .common import Sizes
from .loadgen import LoadResult, Target, run_load
from .services import GatewayServer
from .stats import summary

ROUTES = ("health", "inference", "stream")
# Runs beyond --repeat for the cells the targets read (see _repeats).
TARGET_EXTRA_REPEATS = 2


def target(route: str, base: str) -> Target:
    headers = (("authorization", f"Bearer {TOKEN}"), ("content-type", "application/json"))
    if route == "health":
        return Target(base + HEALTH_PATH, "GET", b"", headers[:1])
    return Target(base + INFERENCE_PATH, "POST", chat_body(stream=route == "stream"), headers)


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (NaN where /proc is unavailable)."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


def measure(
    servers: dict[str, GatewayServer],
    sizes: Sizes,
    repeats: int,
    tool: str,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    runs: dict[tuple[str, int, str], list[tuple[LoadResult, float]]] = {}
    used_tool = ""
    for route in ROUTES:
        duration = sizes.http_health_seconds if route == "health" else sizes.http_seconds
        for conc in sizes.http_concurrency:
            progress(f"HTTP: {route}, concurrency {conc}")
            for rep in range(_repeats(conc, sizes, repeats)):
                shift = (rep + conc) % len(VARIANTS)
                for v in VARIANTS[shift:] + VARIANTS[:shift]:
                    server = servers[v]
                    cpu0 = _cpu_seconds(server.pid)
                    result = run_load(
                        target(route, server.base),
                        concurrency=conc,
                        duration=duration,
                        tool=tool,
                    )
                    cpu = _cpu_seconds(server.pid) - cpu0
                    used_tool = result.tool
                    runs.setdefault((route, conc, v), []).append((result, cpu))
                    # The server finishes its background work (the record writer) before the
                    # next variant's run, so it does not eat into that run.
                    time.sleep(sizes.http_pause)
    return {
        "tool": used_tool,
        "extra_repeats": TARGET_EXTRA_REPEATS,
        "routes": _report(runs, sizes),
    }


def _repeats(conc: int, sizes: Sizes, repeats: int) -> int:
    """More runs for the cells the targets read (every route at the highest concurrency): on a
    shared 2-core VM a run's requests/s drifts with the host by more than spendguard's whole
    cost, and the median of a few more runs, taken in turns with the bare app, moves less."""
    if conc == max(sizes.http_concurrency):
        return repeats + TARGET_EXTRA_REPEATS
    return repeats


def _report(
    runs: dict[tuple[str, int, str], list[tuple[LoadResult, float]]], sizes: Sizes
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for route in ROUTES:
        by_conc: dict[str, Any] = {}
        for conc in sizes.http_concurrency:
            bare = runs[(route, conc, "bare")]
            variants: dict[str, Any] = {}
            for v in VARIANTS:
                mine = runs[(route, conc, v)]
                rps = [r.ok / r.seconds for r, _ in mine]
                bare_rps = [r.ok / r.seconds for r, _ in bare]
                cpu_us = [cpu / max(1, r.requests) * 1e6 for r, cpu in mine]
                bare_cpu = [cpu / max(1, r.requests) * 1e6 for r, cpu in bare]
                variants[v] = {
                    "rps": summary(rps),
                    "p50_us": summary([r.p50_us for r, _ in mine]),
                    "p99_us": summary([r.p99_us for r, _ in mine]),
                    "rps_ratio": summary(
                        [a / b if b else math.nan for a, b in zip(rps, bare_rps, strict=True)]
                    ),
                    "p50_ratio": summary(
                        [a.p50_us / b.p50_us for (a, _), (b, _) in zip(mine, bare, strict=True)]
                    ),
                    "p99_ratio": summary(
                        [a.p99_us / b.p99_us for (a, _), (b, _) in zip(mine, bare, strict=True)]
                    ),
                    "cpu_us_per_request": summary(cpu_us),
                    "added_cpu_us_per_request": summary(
                        [a - b for a, b in zip(cpu_us, bare_cpu, strict=True)]
                    ),
                    "runs": [
                        {
                            "rps": round(r.ok / r.seconds, 1),
                            "p50_us": round(r.p50_us, 1),
                            "p99_us": round(r.p99_us, 1),
                            "cpu_us_per_request": round(cpu / max(1, r.requests) * 1e6, 1),
                        }
                        for r, cpu in mine
                    ],
                    "requests": sum(r.requests for r, _ in mine),
                    "non_2xx": sum(r.requests - r.ok for r, _ in mine),
                    "errors": sum(r.errors for r, _ in mine),
                }
            by_conc[str(conc)] = variants
        out[route] = by_conc
    return out
