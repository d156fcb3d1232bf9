"""What the metric hooks cost one inference.

    python -m benchmarks.metrics_cost [--redis-url URL] [--n 2000] [--rounds 15]

1. ``hooks``: exactly the calls a warm, allowed, charged inference makes (a decision, two
   timed store calls, a charge with input and output tokens), in a tight loop: the best of
   several repeats, in µs per inference. The same sequence on ``prometheus_client`` children
   (``prometheus_client_equivalent``) shows what the lock-free counters save.
2. ``end_to_end``: admit + observe + finish on a warm guard, with the metrics as shipped and
   with every request-path metric swapped for a no-op, taking turns in blocks on one guard and
   one event loop (records kept aside, the writer idle). CPU time per inference
   (``time.process_time_ns``); the median of each variant and of the paired differences. On a
   busy machine the difference is within the noise of a ~130 µs inference: (1) is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spendguard import Settings
from spendguard.engine import guard as guard_module
from spendguard.engine import telemetry
from spendguard.engine.decision import InferenceRequest
from spendguard.engine.guard import SpendGuard
from spendguard.record import InferenceRecord
from spendguard.usage import Dialect

from .apps import INFERENCE_PATH, MODEL
from .common import bench_identity, set_policies

BODY = (
    b'{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}'
)


class _Null:
    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


@contextmanager
def metrics_off() -> Iterator[None]:
    """Every pre-bound child the request path uses, replaced by a no-op."""
    null = _Null()
    saved: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for name in ("_PREFLIGHT_SECONDS", "_POSTFLIGHT_SECONDS", "_RELEASE_SECONDS"):
        swap(guard_module, name, null)
    for name in (
        "_ALLOWED_LIMITED",
        "_ALLOWED_UNLIMITED",
        "_ALLOWED_FAIL_OPEN",
        "_DENIED_BALANCE",
        "_DENIED_MODEL",
        "_SPEND",
        "_INPUT",
        "_OUTPUT",
        "_CACHED",
        "_CACHE_WRITE",
    ):
        swap(telemetry, name, null)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def hook_sequence_us(repeats: int = 7, number: int = 100_000) -> dict[str, float]:
    """µs per inference of the hooks alone, shipped and on prometheus_client children."""
    import timeit

    from prometheus_client import CollectorRegistry, Counter, Histogram

    from spendguard import metrics
    from spendguard.engine.decision import Verdict
    from spendguard.usage import Usage

    usage = Usage(input_tokens=7, output_tokens=5)
    perf = time.perf_counter
    allow = Verdict.ALLOW
    pre, post = metrics.PREFLIGHT_SECONDS, metrics.POSTFLIGHT_SECONDS
    decided, charged = telemetry.decided, telemetry.charged

    def shipped() -> None:
        started = perf()
        pre.observe(perf() - started)
        decided(allow, True, None, False, None)
        charged(15, usage)
        started = perf()
        post.observe(perf() - started)

    registry = CollectorRegistry()
    counter = Counter("c", "", ["outcome", "kind", "period"], registry=registry)
    histogram = Histogram("h", "", ["call"], registry=registry)
    spend = Counter("s", "", registry=registry)
    tokens = Counter("t", "", ["type"], registry=registry)
    c_allow, c_in, c_out = counter.labels("a", "b", "c"), tokens.labels("i"), tokens.labels("o")
    h_pre, h_post = histogram.labels("pre"), histogram.labels("post")

    def classic() -> None:
        started = perf()
        h_pre.observe(perf() - started)
        c_allow.inc()
        spend.inc(15)
        c_in.inc(usage.input_tokens)
        c_out.inc(usage.output_tokens)
        started = perf()
        h_post.observe(perf() - started)

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, repeat=repeats, number=number)) / number * 1e6

    return {
        "hooks_us": round(best(shipped), 2),
        "prometheus_client_equivalent_us": round(best(classic), 2),
    }


async def _block(guard: SpendGuard, n: int) -> int:
    identity = bench_identity()
    start = time.process_time_ns()
    for _ in range(n):
        request = InferenceRequest(MODEL, False, 64, 7)
        admission = await guard.admit(
            identity, request, route=INFERENCE_PATH, dialect=Dialect.OPENAI
        )
        observer = guard.observe(admission, 200, "application/json", None)
        if observer is not None:
            observer.feed(BODY)
        await guard.finish(admission, 200, observer)
    return time.process_time_ns() - start


async def _drop_keys(url: str, prefix: str) -> None:
    """Delete the keys this run made (the server may be shared)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            await client.delete(key)
    finally:
        await client.aclose()


async def run(store_url: str | None, n: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'ledger.db'}"
        await set_policies(url, bench_identity(), now=datetime.now(UTC))
        prefix = f"spendguard-metrics-cost-{os.getpid()}"  # never another user's keys
        settings = Settings(
            database_url=url, redis_url=store_url, run_worker=False, key_prefix=prefix
        )
        guard = SpendGuard(settings)
        await guard.start(worker=False)
        kept: list[InferenceRecord] = []
        guard.recorder.submit = kept.append  # type: ignore[assignment,method-assign]
        try:
            await _block(guard, 200)  # warm: caches filled, code paths run
            on: list[float] = []
            off: list[float] = []
            for i in range(rounds):
                order = (True, False) if i % 2 == 0 else (False, True)
                for metrics_on in order:
                    kept.clear()
                    if metrics_on:
                        ns = await _block(guard, n)
                    else:
                        with metrics_off():
                            ns = await _block(guard, n)
                    (on if metrics_on else off).append(ns / n / 1000)
        finally:
            await guard.stop()
            if store_url is not None:
                await _drop_keys(store_url, prefix)
    diffs = [a - b for a, b in zip(on, off, strict=True)]
    return {
        **hook_sequence_us(),
        "store": "redis" if store_url else "embedded",
        "inferences_per_block": n,
        "rounds": rounds,
        "cpu_us_per_inference_metrics_on": round(statistics.median(on), 2),
        "cpu_us_per_inference_metrics_off": round(statistics.median(off), 2),
        "added_us_median": round(statistics.median(diffs), 2),
        "added_us_quartiles": [round(q, 2) for q in statistics.quantiles(diffs, n=4)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=None, help="the Redis store (default: embedded)")
    parser.add_argument("--n", type=int, default=2000, help="inferences per block")
    parser.add_argument("--rounds", type=int, default=15, help="blocks of each variant")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.redis_url, args.n, args.rounds)), indent=2))


if __name__ == "__main__":
    main()
