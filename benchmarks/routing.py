"""1c. Route matching and the safety net: what deciding "is this an inference?" costs.

Every request the middleware sees goes through ``RouteTable.match``; a POST, PUT or PATCH that
matches no guarded route then goes through the safety net for unlisted inferences
(``asgi/unlisted.py``), which reads its body and parses it when it is JSON. Two measurements:

- ``RouteTable.match`` per call on the default table, for the exact default path, variant
  spellings of it, a pattern route (an Azure deployment, the model from the path), a prefix
  only the last pattern takes, an unmatched POST and a GET; and the same lookups on the
  previous release's table (``_PreviousRouteTable`` below, its 6 exact default routes), their
  batches taking turns with this release's, so that the ratio is of one run. Then the safety
  net's own steps on an unmatched POST: the pass-route lookup, ``looks_like_inference`` on a
  ~1 KB JSON body, and ``json.loads`` of that body alone. Each figure is the median over
  batches of calls, with the collector off while they run, like ``timeit``; the batches of all
  cases take turns.
- Through the ASGI stack, as section 1 does it (the example gateway in process, raw ASGI
  calls, no sockets): the bare app against the same app with spendguard on the embedded store,
  for an inference on the exact path, the same inference on a variant spelling, a non-inference
  POST with a ~1 KB JSON body to a route the app serves, and a GET. Per request: the time of the
  whole ASGI call (p50, p99) and the process's CPU, the record writer's included (it is drained
  after each block, inside the CPU timing and outside the latency timing).

Run on its own with ``python -m benchmarks.routing [--quick] [--repeat N] [--json FILE]``: it
needs no Redis or PostgreSQL (the embedded store's SQLite ledger lives in a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Final

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Scope

from spendguard.asgi.routes import RouteTable
from spendguard.asgi.unlisted import looks_like_inference
from spendguard.settings import DEFAULT_PASS_ROUTES, DEFAULT_ROUTES, load_settings
from spendguard.usage import Dialect

from .apps import HEALTH_PATH, INFERENCE_PATH, TOKEN, _plain_proxy, build_gateway, chat_body
from .asgi import Call, http_scope, lifespan
from .common import Sizes, bench_identity, find_guard, set_policies
from .stats import percentile, summary

# ---------------------------------------------------------------------------------------------
# The previous release's route table (commit 0a34004, spendguard/asgi/routes.py), kept here so
# that every run compares against it on the same machine in the same minutes.

_PREVIOUS_DEFAULT_ROUTES: Final = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/messages",
    "/anthropic/v1/messages",
)


def _previous_route_pattern(path: str) -> re.Pattern[str] | None:
    # The previous route_pattern without its validation: only its own defaults are built here.
    if "{" not in path and "}" not in path:
        return None
    return compile_path(path)[0]


def _previous_dialect_of(path: str) -> Dialect:
    return Dialect.ANTHROPIC if path.rsplit("/", 1)[-1] == "messages" else Dialect.OPENAI


class _PreviousRouteTable:
    """Exact-path lookup: one dict probe per request keeps non-inference traffic untouched.

    Paths are compared without a trailing slash and relative to the app's ``root_path``, so a
    gateway mounted under a prefix matches the same routes; a route written with the mount's
    prefix (``/llm/v1/chat/completions``) matches too. Patterns with path parameters are tried
    only when no exact path matched.
    """

    __slots__ = ("_patterns", "_routes", "paths")

    def __init__(self, paths: Iterable[str]) -> None:
        self._routes: dict[str, Dialect] = {}
        self._patterns: list[re.Pattern[str]] = []
        self.paths: tuple[str, ...] = ()
        for path in paths:
            norm = path.rstrip("/") or "/"
            self.paths += (norm,)
            pattern = _previous_route_pattern(norm)
            if pattern is None:
                self._routes[norm] = _previous_dialect_of(norm)
            else:
                self._patterns.append(pattern)

    def match(self, scope: Scope) -> tuple[str, Dialect] | None:
        if scope["method"] != "POST":
            return None
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/")
        dialect = self._routes.get(path)
        if dialect is not None:
            return path, dialect
        if root or self._patterns:
            return self._match_further(path, scope["path"].rstrip("/") or "/")
        return None

    def _match_further(self, path: str, full: str) -> tuple[str, Dialect] | None:
        """The slower cases: the full path under a mount, and the patterns."""
        if full != path and (dialect := self._routes.get(full)) is not None:
            return full, dialect
        for candidate in (path, full) if full != path else (path,):
            for pattern in self._patterns:
                if pattern.match(candidate):
                    return candidate, _previous_dialect_of(candidate)
        return None


# ---------------------------------------------------------------------------------------------
# What is looked up and sent

VARIANT_PATH: Final = "/v1//chat/completions"  # a base URL with a trailing slash, joined
ADMIN_PATH: Final = "/key/generate"  # a gateway's own POST route: key management
AZURE_PATH: Final = "/openai/deployments/gpt-4o-mini/chat/completions"

# (id, label, method, path) of every RouteTable.match case.
MATCH_CASES: Final = (
    ("exact", "exact default path", "POST", INFERENCE_PATH),
    ("double_slash", "variant spelling: repeated slash", "POST", VARIANT_PATH),
    ("upper_case", "variant spelling: upper case", "POST", "/V1/chat/completions"),
    ("azure", "Azure deployment (pattern, model from the path)", "POST", AZURE_PATH),
    ("other_prefix", "another prefix (the last pattern)", "POST", "/gateway/v1/chat/completions"),
    ("unmatched_post", "unmatched POST", "POST", ADMIN_PATH),
    ("get", "GET", "GET", HEALTH_PATH),
)

# (id, label, method, path) of every request sent through the ASGI stack.
ASGI_CASES: Final = (
    ("inference", "inference, exact path", "POST", INFERENCE_PATH),
    ("inference_variant", "inference, variant spelling", "POST", VARIANT_PATH),
    ("admin_post", "non-inference POST, ~1 KB JSON", "POST", ADMIN_PATH),
    ("get", "non-inference GET", "GET", HEALTH_PATH),
)
ASGI_VARIANTS: Final = ("bare", "embedded")


def admin_body(size: int = 1024) -> bytes:
    """A key-management request of about ``size`` bytes: JSON, and no inference."""
    body: dict[str, Any] = {
        "key_alias": "bench-team-key",
        "team_id": "acme",
        "models": ["gpt-4o-mini", "gpt-4o", "claude-3-5-sonnet"],
        "max_budget": 100.0,
        "budget_duration": "30d",
        "metadata": {},
    }
    length = len(json.dumps(body, separators=(",", ":")))
    for i in itertools.count():
        key, value = f"tag_{i:02d}", f"value-{i:04d}"
        length += len(key) + len(value) + 6  # two pairs of quotes, the colon, the comma
        if length > size:
            break
        body["metadata"][key] = value
    encoded = json.dumps(body, separators=(",", ":")).encode()
    if looks_like_inference(encoded, "application/json"):
        raise AssertionError("the non-inference body reads as an inference")
    return encoded


# ---------------------------------------------------------------------------------------------
# RouteTable.match per call


def _per_call_ns(fn: Callable[[Any], object], arg: Any, n: int) -> float:
    clock = time.perf_counter_ns
    start = clock()
    for a in itertools.repeat(arg, n):
        fn(a)
    return (clock() - start) / n


def _matched(found: tuple[Any, ...] | None) -> str | None:
    """What a table answered, for the report: the route it matched (and the path's model)."""
    if found is None:
        return None
    model = found[2] if len(found) > 2 else None
    return f"{found[0]} (model {model})" if model else str(found[0])


def measure_match(sizes: Sizes, repeats: int) -> dict[str, Any]:
    tables: dict[str, Callable[[Scope], tuple[Any, ...] | None]] = {
        "new": RouteTable(DEFAULT_ROUTES).match,
        "previous": _PreviousRouteTable(_PREVIOUS_DEFAULT_ROUTES).match,
    }
    passes = RouteTable(DEFAULT_PASS_ROUTES)
    body = admin_body()
    scopes = {case: http_scope(method, path) for case, _, method, path in MATCH_CASES}
    admin_scope = http_scope("POST", ADMIN_PATH)
    # (figure id, function, argument): every batch of every figure, taking turns.
    jobs: list[tuple[str, Callable[[Any], object], Any]] = [
        (f"{table}/{case}", fn, scopes[case]) for case in scopes for table, fn in tables.items()
    ]
    jobs += [
        ("steps/pass_route_lookup", passes.lookup, admin_scope),
        ("steps/looks_like_inference", lambda b: looks_like_inference(b, "application/json"), body),
        ("steps/json_loads", json.loads, body),
    ]
    n = sizes.route_calls
    per_repeat: dict[str, list[float]] = {job: [] for job, _, _ in jobs}
    for _ in range(repeats):
        batches: dict[str, list[float]] = {job: [] for job, _, _ in jobs}
        enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for _, fn, arg in jobs:  # warm: caches, regexes, the specialising interpreter
                _per_call_ns(fn, arg, n)
            for i in range(sizes.route_batches):
                for job, fn, arg in jobs[i % len(jobs) :] + jobs[: i % len(jobs)]:
                    batches[job].append(_per_call_ns(fn, arg, n))
        finally:
            if enabled:
                gc.enable()
        for job, values in batches.items():
            per_repeat[job].append(percentile(values, 50))
    cases: dict[str, Any] = {}
    for case, label, method, path in MATCH_CASES:
        new, old = per_repeat[f"new/{case}"], per_repeat[f"previous/{case}"]
        cases[case] = {
            "label": label,
            "method": method,
            "path": path,
            "new": {"ns": summary(new), "matched": _matched(tables["new"](scopes[case]))},
            "previous": {"ns": summary(old), "matched": _matched(tables["previous"](scopes[case]))},
            "ratio": summary([a / b for a, b in zip(new, old, strict=True)]),
        }
    steps = {
        name: {"ns": summary(per_repeat[f"steps/{name}"])}
        for name in ("pass_route_lookup", "looks_like_inference", "json_loads")
    }
    return {
        "calls_per_batch": n,
        "batches": sizes.route_batches,
        "routes": {"new": len(DEFAULT_ROUTES), "previous": len(_PREVIOUS_DEFAULT_ROUTES)},
        "cases": cases,
        "safety_net_steps": steps,
        "body_bytes": len(body),
    }


# ---------------------------------------------------------------------------------------------
# Through the ASGI stack


async def _admin(request: Request) -> Response:
    # A key-management handler: it reads its JSON body and answers; the same in both variants.
    await request.body()
    return JSONResponse({"key": "sk-bench-generated"})


async def _variant_inference(request: Request) -> Response:
    # The app serves the variant spelling and sends its upstream the plain path, as a catch-all
    # proxy or a normalising router does.
    return await _plain_proxy(request, INFERENCE_PATH)


def routing_gateway(variant: str, database_url: str) -> ASGIApp:
    """The benchmark gateway of ``variant`` with two more routes: the variant spelling of the
    inference path, and a non-inference POST route."""
    settings = load_settings(database_url=database_url, run_worker=False)
    app = build_gateway(variant, settings=settings if variant != "bare" else None)
    if not isinstance(app, FastAPI):
        raise TypeError(f"build_gateway answered {type(app).__name__}, not a FastAPI app")
    app.add_api_route(VARIANT_PATH, _variant_inference, methods=["POST"])
    app.add_api_route(ADMIN_PATH, _admin, methods=["POST"])
    return app


_AUTH: Final = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"host", b"gateway")]


def _asgi_call(app: ASGIApp, method: str, path: str) -> Call:
    if method == "GET":
        return Call(app, http_scope(method, path, _AUTH))
    body = admin_body() if path == ADMIN_PATH else chat_body()
    headers = [*_AUTH, (b"content-type", b"application/json")]
    return Call(app, http_scope(method, path, headers, body), body)


async def _block(call: Call, n: int, out: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        status, done = await call()
        out.append(clock() - start)
        if status != 200 or not done:
            raise RuntimeError(f"benchmark request answered {status}")


async def measure_asgi(
    database_url: str, sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    await set_policies(database_url, bench_identity())
    counts = {
        case: sizes.inproc_inference if case.startswith("inference") else sizes.inproc_health
        for case, *_ in ASGI_CASES
    }
    latency: list[dict[str, dict[str, list[int]]]] = []
    cpu: list[dict[str, dict[str, int]]] = []
    async with AsyncExitStack() as stack:
        apps = {v: routing_gateway(v, database_url) for v in ASGI_VARIANTS}
        for app in apps.values():
            await stack.enter_async_context(lifespan(app))
        guards = [g for g in (find_guard(app) for app in apps.values()) if g is not None]
        calls = {
            v: {case: _asgi_call(app, method, path) for case, _, method, path in ASGI_CASES}
            for v, app in apps.items()
        }

        async def drain() -> None:
            for guard in guards:
                await guard.recorder.flush()

        for v in ASGI_VARIANTS:
            for case, *_ in ASGI_CASES:
                await _block(calls[v][case], sizes.inproc_warmup, [])
        await drain()
        for rep in range(repeats):
            progress(f"routing, through the ASGI stack: repeat {rep + 1}/{repeats}")
            samples: dict[str, dict[str, list[int]]] = {c: {} for c, *_ in ASGI_CASES}
            cpu_ns: dict[str, dict[str, int]] = {c: {} for c, *_ in ASGI_CASES}
            for case, *_ in ASGI_CASES:
                block = sizes.inproc_block * (1 if case.startswith("inference") else 4)
                gc.collect()
                for i in range(max(1, counts[case] // block)):
                    for v in ASGI_VARIANTS[i % 2 :] + ASGI_VARIANTS[: i % 2]:
                        start = time.process_time_ns()
                        await _block(calls[v][case], block, samples[case].setdefault(v, []))
                        await drain()
                        spent = time.process_time_ns() - start
                        cpu_ns[case][v] = cpu_ns[case].get(v, 0) + spent
            latency.append(samples)
            cpu.append(cpu_ns)
    return _asgi_report(latency, cpu)


def _asgi_report(
    latency: list[dict[str, dict[str, list[int]]]], cpu: list[dict[str, dict[str, int]]]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, label, method, path in ASGI_CASES:
        stats: dict[str, dict[str, list[float]]] = {v: {} for v in ASGI_VARIANTS}
        for samples, cpu_ns in zip(latency, cpu, strict=True):
            bare = samples[case]["bare"]
            b50, b99 = percentile(bare, 50) / 1000, percentile(bare, 99) / 1000
            b_cpu = cpu_ns[case]["bare"] / len(bare) / 1000
            for v in ASGI_VARIANTS:
                mine = samples[case][v]
                p50, p99 = percentile(mine, 50) / 1000, percentile(mine, 99) / 1000
                cpu_us = cpu_ns[case][v] / len(mine) / 1000
                figures = {"p50_us": p50, "p99_us": p99, "cpu_us_per_request": cpu_us}
                if v != "bare":
                    figures |= {
                        "added_p50_us": p50 - b50,
                        "added_p99_us": p99 - b99,
                        "added_cpu_us_per_request": cpu_us - b_cpu,
                    }
                for name, value in figures.items():
                    stats[v].setdefault(name, []).append(value)
        out[case] = {
            "label": label,
            "method": method,
            "path": path,
            "requests": len(latency[0][case]["bare"]),
            **{v: {k: summary(xs) for k, xs in stats[v].items()} for v in ASGI_VARIANTS},
        }
    return out


async def measure(
    database_url: str, sizes: Sizes, repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    progress("routing: RouteTable.match and the safety net's steps, per call")
    match = measure_match(sizes, repeats)
    return {**match, "asgi": await measure_asgi(database_url, sizes, repeats, progress)}


def main(argv: Sequence[str] | None = None) -> int:
    from .report import routing_section

    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of every measurement")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    sizes = Sizes.quick() if args.quick else Sizes.full()
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="spendguard-bench-") as workdir:
        url = f"sqlite:///{Path(workdir) / 'routing.db'}"
        results = asyncio.run(measure(url, sizes, args.repeat, progress))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    print("\n".join(routing_section(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
