"""1. In-process overhead: raw ASGI calls, no sockets.

The bare gateway and the same gateway with spendguard (embedded store, Redis store) and with
the peer limiter all run in one event loop, their lifespans started, caches warm. Variants take
turns in blocks, in an order that rotates every round, so drift (CPU frequency, GC, a noisy
neighbour) hits all of them alike. Each request is timed with ``perf_counter_ns`` around the
ASGI call: preflight, the proxied call to the fake provider, and postflight are all inside.

spendguard's record writer is a background task on the same event loop: within a block it runs
as in production, between the awaits of the variant's own requests, so its CPU shows in that
variant's latency. What it still holds at the end of a block is written before the next
variant's turn, untimed, so it never lands in another variant's figures.

The floor: what Redis round trips cost on this machine with none of spendguard's code. The
bare gateway behind one ``PING`` round trip to the same redis-server before the app (a Redis
store cannot admit with less), and the embedded-store gateway with one ``PING`` before the app
and one after it (the Redis store's two round trips on the embedded store's code), each sent
by the minimal hiredis client of ``redis_path.py``. Their added time is what the Redis targets
read against: where one bare round trip already costs more than a target allows, no client
can meet it here.

Two breakdowns say where spendguard's time goes. The inference route is also timed with the
record writer out of the way (records kept aside and written between blocks, untimed): the
difference is what the writer's work costs the requests it shares the loop with. And the
engine alone, ``SpendGuard.preflight`` and ``SpendGuard.postflight`` called directly on the same
warm guards (records aside too): what the store path costs, apart from the middleware.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from spendguard import Settings
from spendguard.engine.guard import SpendGuard
from spendguard.record import InferenceRecord
from spendguard.settings import load_settings
from spendguard.usage import Usage

from .apps import HEALTH_PATH, INFERENCE_PATH, MODEL, TOKEN, VARIANTS, build_gateway, chat_body
from .asgi import Call, http_scope, lifespan
from .common import Services, Sizes, bench_identity, find_guard, set_policies
from .redis_path import HiredisMinimal, pack
from .stats import percentile, summary

ROUTES = ("inference", "health")
ASIDE = ("embedded", "redis")  # also timed with their records kept aside (inference only)
# The floor variants (inference only): (the gateway they wrap, PINGs before, PINGs after).
FLOORS = {"one round trip": ("bare", 1, 0), "two round trips": ("embedded", 1, 1)}


class RoundTrips:
    """An app behind bare Redis round trips on an inference route: ``before`` PINGs before the
    app is called, ``after`` more once it returned (see the module docstring, "The floor")."""

    def __init__(self, app: Any, redis: HiredisMinimal, before: int, after: int) -> None:
        self._app, self._redis, self._before, self._after = app, redis, before, after
        self._ping = pack("PING")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != INFERENCE_PATH:
            await self._app(scope, receive, send)
            return
        for _ in range(self._before):
            await self._redis.call(self._ping)
        try:
            await self._app(scope, receive, send)
        finally:
            for _ in range(self._after):
                await self._redis.call(self._ping)


@asynccontextmanager
async def records_aside(guard: SpendGuard) -> AsyncIterator[list[InferenceRecord]]:
    """Keep the guard's records in a list instead of waking its writer; write them on exit.

    The writer would otherwise run inside the awaits of the requests being timed. Only an
    instance attribute is swapped, for the duration of the block.
    """
    kept: list[InferenceRecord] = []

    def keep(record: InferenceRecord) -> bool:
        kept.append(record)
        return True

    setattr(guard.recorder, "submit", keep)  # noqa: B010 (an instance attribute, on purpose)
    try:
        yield kept
    finally:
        delattr(guard.recorder, "submit")
        if kept:
            await guard.ledger.insert_records(kept)


def variant_settings(variant: str, services: Services) -> Settings | None:
    # The settlement worker is left to section 4 (and to its own process in production at
    # scale): here its passes would land in whichever variant is being timed.
    if variant == "embedded":
        return load_settings(database_url=services.sqlite_url, run_worker=False)
    if variant == "redis":
        return load_settings(
            database_url=services.postgres_url, redis_url=services.redis_url, run_worker=False
        )
    return None


_AUTH = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"host", b"gateway")]


def inference_call(app: Any, *, stream: bool = False) -> Call:
    """A chat completion from the demo key, as the gateway's clients send it."""
    body = chat_body(stream=stream)
    headers = [*_AUTH, (b"content-type", b"application/json")]
    return Call(app, http_scope("POST", INFERENCE_PATH, headers, body), body)


def _calls(app: Any) -> dict[str, Call]:
    return {
        "inference": inference_call(app),
        "health": Call(app, http_scope("GET", HEALTH_PATH, _AUTH)),
    }


async def _timed_block(call: Call, n: int, out: list[int], last_byte: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        status, done = await call()
        out.append(clock() - start)
        last_byte.append(done - start)
        if status != 200 or not done:
            raise RuntimeError(f"benchmark request answered {status}")


async def measure(
    services: Services, sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    identity = bench_identity()
    await set_policies(services.sqlite_url, identity)
    await set_policies(services.postgres_url, identity)
    per_repeat: list[dict[str, dict[str, list[int]]]] = []
    per_repeat_last_byte: list[dict[str, list[int]]] = []
    async with AsyncExitStack() as stack:
        apps = {
            v: build_gateway(
                v, settings=variant_settings(v, services), redis_url=services.redis_url
            )
            for v in VARIANTS
        }
        for app in apps.values():
            await stack.enter_async_context(lifespan(app))
        guards = {v: find_guard(app) for v, app in apps.items()}
        calls = {v: _calls(app) for v, app in apps.items()}
        ping = await HiredisMinimal.connect(services.redis_url)
        stack.callback(ping.close)
        for name, (wrapped, before, after) in FLOORS.items():
            calls[name] = {
                "inference": inference_call(RoundTrips(apps[wrapped], ping, before, after))
            }

        async def drain() -> None:
            for guard in guards.values():
                if guard is not None:
                    await guard.recorder.flush()

        # Warm-up: connections, script registration, policy and usage caches, code paths.
        for v in VARIANTS:
            for route in ROUTES:
                await _timed_block(calls[v][route], sizes.inproc_warmup, [], [])
        for name in FLOORS:
            await _timed_block(calls[name]["inference"], sizes.inproc_warmup, [], [])
        await drain()

        for rep in range(repeats):
            progress(f"in-process: repeat {rep + 1}/{repeats}")
            samples: dict[str, dict[str, list[int]]] = {
                r: {v: [] for v in (*VARIANTS, *(f"{a}/aside" for a in ASIDE), *FLOORS)}
                for r in ROUTES
            }
            # Inference route.
            last_byte: dict[str, list[int]] = {v: [] for v in (*VARIANTS, *FLOORS)}
            for route, total in (
                ("inference", sizes.inproc_inference),
                ("health", sizes.inproc_health),
            ):
                block = sizes.inproc_block if route == "inference" else sizes.inproc_block * 4
                labels = [*VARIANTS]
                if route == "inference":
                    labels += [*(f"{a}/aside" for a in ASIDE), *FLOORS]
                rounds = max(1, total // block)
                gc.collect()
                for i in range(rounds):
                    for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                        v, aside, _ = label.partition("/")
                        out = samples[route][label]
                        lb = last_byte[v] if route == "inference" and not aside else []
                        guard = guards.get(v)
                        if aside and guard is not None:
                            async with records_aside(guard):
                                await _timed_block(calls[v][route], block, out, lb)
                        else:
                            await _timed_block(calls[v][route], block, out, lb)
                        await drain()
            per_repeat.append(samples)
            per_repeat_last_byte.append(last_byte)
        engine = {
            v: await _engine(guard, sizes, repeats)
            for v, guard in guards.items()
            if guard is not None
        }
    return {
        **_report(per_repeat),
        "last_byte": _last_byte_report(per_repeat_last_byte),
        "floor": _floor_report(per_repeat, per_repeat_last_byte),
        "engine": engine,
    }


def _floor_report(
    per_repeat: list[dict[str, dict[str, list[int]]]],
    per_repeat_last_byte: list[dict[str, list[int]]],
) -> dict[str, Any]:
    """The floor variants, as the Redis targets read them: the whole ASGI call's added p50
    and p99, and the last byte's."""
    inference = [samples["inference"] for samples in per_repeat]
    out: dict[str, Any] = {}
    for name in FLOORS:
        last_byte = _added(per_repeat_last_byte, name)
        out[name] = {
            "last_byte_added_p50_us": last_byte["added_p50_us"],
            "last_byte_added_p99_us": last_byte["added_p99_us"],
            **_added(inference, name),
        }
    return out


def _last_byte_report(per_repeat: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Inference route, request start to the last response byte sent."""
    return {
        v: {
            "p50_us": summary([percentile(samples[v], 50) / 1000 for samples in per_repeat]),
            **_added(per_repeat, v),
        }
        for v in VARIANTS
    }


async def _engine(guard: SpendGuard, sizes: Sizes, repeats: int) -> dict[str, Any]:
    """p50/p99 of one preflight and one postflight, called directly (no ASGI, no app)."""
    identity = bench_identity()
    usage = Usage(input_tokens=7, output_tokens=5)
    stats: dict[str, list[float]] = {}
    clock = time.perf_counter_ns
    async with records_aside(guard) as kept:
        for _ in range(repeats):
            pre: list[int] = []
            post: list[int] = []
            for i in range(sizes.inproc_inference):
                t0 = datetime.now(UTC)
                start = clock()
                decision = await guard.preflight(identity, t0)
                mid = clock()
                await guard.postflight(
                    decision, model=MODEL, route=INFERENCE_PATH, status_code=200, usage=usage
                )
                pre.append(mid - start)
                post.append(clock() - mid)
                if i % sizes.inproc_block == 0:
                    await guard.ledger.insert_records(kept)
                    kept.clear()
            for name, samples in (("preflight", pre), ("postflight", post)):
                stats.setdefault(f"{name}_p50_us", []).append(percentile(samples, 50) / 1000)
                stats.setdefault(f"{name}_p99_us", []).append(percentile(samples, 99) / 1000)
    return {name: summary(values) for name, values in stats.items()}


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
    out["records_aside"] = {
        a: _added([samples["inference"] for samples in per_repeat], f"{a}/aside") for a in ASIDE
    }
    return out


def _added(per_repeat: list[dict[str, list[int]]], label: str) -> dict[str, Any]:
    """``label``'s p50 and p99 minus the bare app's of the same repeat, over the repeats (µs)."""
    added50, added99 = [], []
    for samples in per_repeat:
        mine, bare = samples[label], samples["bare"]
        added50.append((percentile(mine, 50) - percentile(bare, 50)) / 1000)
        added99.append((percentile(mine, 99) - percentile(bare, 99)) / 1000)
    return {"added_p50_us": summary(added50), "added_p99_us": summary(added99)}
