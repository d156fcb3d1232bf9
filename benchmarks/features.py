"""Features on: what each request-path feature adds to the ``redis`` gateway variant, in process,
one request at a time, on warm caches, for a single redis-server and a 3-master Redis Cluster.

Four configurations of the same gateway, each on a team of its own (so one's policies never
reach another's):

* ``spend limits``: the key's daily and the team's monthly limit, soft (the other sections'
  setup);
* ``alerts``: the same with threshold alerts at 50, 80 and 100 % of every limit (checked by the
  postflight script on every charge; the limits are never reached, so none fires);
* ``budgets``: the same plus a budgets section (key, model and global scopes, two windows,
  counted on Redis);
* ``everything``: every request-path feature there is: the key's limit hard, a prepaid balance,
  model lists on the key and the team, the budgets section, rate limits on the key and the team
  (requests and tokens per minute, parallel requests), remaining-spend headers, and a
  provider key leased from declared candidates (``provider_candidates``: acquired in the
  admission's round trip, settled in the finishing one; the handler reads the lease from the
  request state) and threshold alerts, all far above what a run uses, so every request is
  checked, reserved and charged, none refused.

Per configuration: the pipelines sent to Redis per inference (sequential round trips: every
part of the gateway's round shares its one store's pipeline), the script calls they carry, the
Redis servers' time in scripts and commands per inference (a script's inner calls included), the
p50 time to the last response byte, and this process's CPU per inference (the gateway and its
upstream, both in process: compare configurations with each other). The gateways live
at once and take turns in blocks of requests, the order reversed every round, so the host's
drift (large on a shared VM) falls on all of them alike instead of on whichever ran last.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AsyncExitStack
from typing import Any, Final

from fastapi import FastAPI
from redis import Redis as SyncRedis
from redis.cluster import RedisCluster as SyncCluster
from redis.crc import key_slot
from starlette.requests import Request
from starlette.responses import Response

from examples import gateway
from spendguard import SpendGuardMiddleware
from spendguard.engine.guard import SpendGuard
from spendguard.providers import ProviderKey
from spendguard.settings import load_settings
from spendguard.store.rolling import SHARED_SLOT
from tests.support import RedisCluster

from .apps import HEALTH_PATH, INFERENCE_PATH, MODEL, chat_body
from .asgi import Call, http_scope, lifespan
from .common import HIGH_LIMIT_MICROS, Services, Sizes, find_guard, section_args
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
# What each configuration turns on over spend limits alone (the key's daily, the team's monthly).
FEATURES: Final = ("hard", "balance", "models", "rates", "headers", "alerts", "budgets", "pool")
SETS: Final[dict[str, frozenset[str]]] = {
    "spend limits": frozenset(),
    "alerts": frozenset({"alerts"}),
    "budgets": frozenset({"budgets"}),
    "everything": frozenset(FEATURES),
    # ``--each``: one feature at a time.
    "hard limit": frozenset({"hard"}),
    "balance": frozenset({"balance"}),
    "model lists": frozenset({"models"}),
    "rates": frozenset({"rates"}),
    "remaining headers": frozenset({"headers"}),
    "provider pool": frozenset({"pool"}),
    # The same without holds stocked in the shared budget buckets (every request reserves
    # there): what the stock buys.
    "budgets without stock": frozenset({"budgets", "nostock"}),
    "everything without stock": frozenset({*FEATURES, "nostock"}),
}
CONFIGS: Final = ("spend limits", "alerts", "budgets", "everything")
EACH: Final = (
    "spend limits",
    "hard limit",
    "balance",
    "model lists",
    "rates",
    "remaining headers",
    "alerts",
    "budgets",
    "provider pool",
    "everything",
)
ALERTS: Final = "50,80,100"  # threshold alerts on every spend limit (never reached in a run)
KEY: Final = "k"
POOL_KEY: Final = "bench-upstream"

# One team per configuration, single node or cluster, and repeat: the example's auth looks
# bearer tokens up in its DEMO_KEYS table.
_runs = 0


def _cluster_node(tag: str) -> int:
    """Which master of ``tests.support.RedisCluster`` (``redis-cli --cluster create``: three
    even slot ranges) holds hash tag ``tag``."""
    slot = key_slot(f"{{{tag}}}".encode())
    return 0 if slot <= 5460 else 1 if slot <= 10922 else 2


def _register_team() -> tuple[str, str]:
    """A team of its own, whose slot is on another Cluster node than the shared slot's (as two
    teams in three are): its rounds write to two nodes, the common case, not one."""
    global _runs
    _runs += 1
    while _cluster_node(f"feat{_runs}") == _cluster_node(SHARED_SLOT):
        _runs += 1
    team, token = f"feat{_runs}", f"sk-bench-feat-{_runs}"
    gateway.DEMO_KEYS[token] = (team, KEY)
    return team, token


async def _leased_proxy(request: Request) -> Response:
    """The benchmarks' plain proxy, calling upstream with the provider key spendguard leased
    for the request at admission (it settles the lease when the response ends)."""
    lease = request.state.spendguard_provider_key
    assert lease.key_id == POOL_KEY
    from .apps import _inference

    return await _inference(request)


def _app(settings: Any, pooled: bool) -> Any:
    from .apps import _inference

    app = FastAPI(title="demo gateway", lifespan=gateway.lifespan)
    app.add_api_route(INFERENCE_PATH, _leased_proxy if pooled else _inference, methods=["POST"])
    app.add_api_route(HEALTH_PATH, gateway.health, methods=["GET"])
    app.add_middleware(SpendGuardMiddleware, settings=settings)
    app.add_middleware(gateway.BearerAuth)
    return app


def _middleware(app: Any) -> SpendGuardMiddleware:
    node: Any = getattr(app, "middleware_stack", None) or app
    while not isinstance(node, SpendGuardMiddleware):
        node = node.app
    return node


def _pipelines(app: Any) -> tuple[int, int]:
    """Pipelines sent so far to Redis on the request path, and the script calls they carried,
    over every distinct pipeline the gateway's stores use."""
    guard = find_guard(app)
    assert guard is not None
    found: dict[int, Any] = {}
    stores: list[Any] = [guard.store]
    gate = _middleware(app).budgets
    if gate is not None and gate.redis is not None:
        stores.append(gate.redis)
    if guard._pool is not None:
        stores.append(guard._pool.store)
    for store in stores:
        pipeline = getattr(store, "pipeline", None)
        if pipeline is not None:
            found[id(pipeline)] = pipeline
    # The records writer sends the carried writes still waiting before it removes their
    # requests' entries (engine/carryover.py): a round of its own, off the request path, as
    # the entries' removal is (not counted either). Sent in the same loop turn as a request's
    # calls, it shares their pipeline instead, and the block reads one round fewer.
    alone = guard.carryover.sent_alone if guard.carryover is not None else 0
    return (
        sum(p.stats.batches for p in found.values()) - alone,
        sum(p.stats.calls for p in found.values()),
    )


async def _configure(guard: SpendGuard, team: str, config: str) -> None:
    admin = guard.admin
    usd = HIGH_LIMIT_MICROS // 10**6
    on = SETS[config]
    await admin.set_policy(team, KEY, window="day", limit_usd=usd, hard="hard" in on)
    await admin.set_policy(team, window="month", limit_usd=usd)
    if "balance" in on:
        await admin.topup(team, usd)
    if "models" in on:
        await admin.allow_models(team, KEY, ["gpt-4o*"])
        await admin.allow_models(team, None, ["gpt-*", "claude-*"])
    if "rates" in on:  # RPM, TPM and parallel requests, on the key and the team
        for key in (KEY, None):
            await admin.set_rates(team, key, rpm=10**9, tpm=10**12, max_parallel=10**6)


async def _prepared(
    stack: AsyncExitStack,
    redis_url: str,
    postgres_url: str,
    config: str,
    sizes: Sizes,
    prefix: str = "bench-features",
) -> tuple[Call, Any]:
    """One configuration's gateway, started (its lifespan held by ``stack``), configured and
    warm: its call and its app. ``prefix``: its Redis keys' (gateways of other processes on
    the same server take one of their own: their teams' names repeat)."""
    extra: dict[str, Any] = {}
    on = SETS[config]
    if "budgets" in on:
        extra["budgets"] = BUDGETS
    if "alerts" in on:
        extra["alert_thresholds"] = ALERTS
    if "headers" in on:
        extra["remaining_headers"] = True
    if "pool" in on:
        extra["provider_candidates"] = {"*": [POOL_KEY]}
    if "nostock" in on:
        extra["budget_stock"] = 0
    settings = load_settings(
        database_url=postgres_url,
        redis_url=redis_url,
        run_worker=False,
        redis_timeout=2.0,
        key_prefix=prefix,
        **extra,
    )
    pooled = "pool" in on
    team, token = _register_team()
    app = _app(settings, pooled)
    auth = [(b"authorization", f"Bearer {token}".encode()), (b"content-type", b"application/json")]
    body = chat_body()
    call = Call(app, http_scope("POST", INFERENCE_PATH, auth, body), body)
    await stack.enter_async_context(lifespan(app))
    guard = find_guard(app)
    assert guard is not None
    await _configure(guard, team, config)
    if pooled:
        await guard.pool.register(ProviderKey(POOL_KEY, "openai", tpm=10**12, rpm=10**9))
    for _ in range(max(20, sizes.inproc_warmup // 4)):
        status, _ = await call()
        if status != 200:
            raise RuntimeError(f"benchmark request answered {status} ({config})")
    return call, app


# The commands whose time includes their inner commands': a script's time already holds that of
# every ``redis.call`` it makes, which ``INFO commandstats`` also books under those commands.
_SCRIPT_COMMANDS: Final = frozenset(
    {"cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro", "cmdstat_fcall"}
)


class ServerStats:
    """The Redis servers' own work, summed over every node: microseconds spent in scripts and
    commands run (a script's ``redis.call``s count as commands of their own, and so does the
    script), read from ``INFO commandstats`` around each gateway's blocks.

    The time is the scripts' alone: everything on the request path is a script, and a
    script's time includes its inner commands, which the server books a second time under
    their own names (summing every entry counted those twice)."""

    def __init__(self, url: str) -> None:
        self._client: Any = (
            SyncCluster.from_url(url.replace("redis+cluster://", "redis://", 1))
            if url.startswith("redis+cluster://")
            else SyncRedis.from_url(url)
        )
        self._cluster = isinstance(self._client, SyncCluster)

    def _infos(self) -> list[dict[str, Any]]:
        if self._cluster:
            got = self._client.info("commandstats", target_nodes=SyncCluster.ALL_NODES)
            return list(got.values())
        return [self._client.info("commandstats")]

    def read(self) -> tuple[int, int]:
        """(µs in scripts, commands) so far, this benchmark's reads left out."""
        usec = calls = 0
        for info in self._infos():
            for name, stat in info.items():
                if name in ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_cluster|nodes"):
                    continue
                if name in _SCRIPT_COMMANDS:
                    usec += int(stat["usec"])
                calls += int(stat["calls"])
        return usec, calls

    def close(self) -> None:
        self._client.close()


async def _run(
    redis_url: str, postgres_url: str, sizes: Sizes, configs: tuple[str, ...] = CONFIGS
) -> dict[str, dict[str, float]]:
    """Every configuration's gateway alive at once, measured in alternating blocks (the order
    reversed every round), so that the host's drift lands on all of them alike and cancels out
    of their ratios."""
    n = max(50, sizes.inproc_inference // 4)
    block = max(10, sizes.inproc_block)
    async with AsyncExitStack() as stack:
        gateways = {c: await _prepared(stack, redis_url, postgres_url, c, sizes) for c in configs}
        # Configuring a later gateway's team (model lists, rates) makes the earlier ones read
        # their policies once more: warm them all again before anything is counted.
        for call, _ in gateways.values():
            for _ in range(5):
                await call()
        times: dict[str, list[int]] = {c: [] for c in configs}
        cpu = dict.fromkeys(configs, 0.0)
        # Counted within each gateway's own blocks: what another's turn left in flight (its
        # records' background writes) is not this one's.
        sent = {c: [0, 0] for c in configs}
        server = ServerStats(redis_url)
        work = {c: [0, 0] for c in configs}
        for turn in range(-(-n // block)):
            for config in configs if turn % 2 == 0 else reversed(configs):
                call, app = gateways[config]
                before = _pipelines(app)
                server_before = server.read()
                started = time.process_time()
                for _ in range(block):
                    start = time.perf_counter_ns()
                    status, done = await call()
                    if status != 200:
                        raise RuntimeError(f"benchmark request answered {status} ({config})")
                    times[config].append(done - start)
                cpu[config] += time.process_time() - started
                after = _pipelines(app)
                server_after = server.read()
                work[config][0] += server_after[0] - server_before[0]
                work[config][1] += server_after[1] - server_before[1]
                sent[config][0] += after[0] - before[0]
                sent[config][1] += after[1] - before[1]
    server.close()
    out: dict[str, dict[str, float]] = {}
    for config in configs:
        count = len(times[config])
        out[config] = {
            "p50_us": percentile(times[config], 50) / 1000,
            "pipelines_per_inference": sent[config][0] / count,
            "scripts_per_inference": sent[config][1] / count,
            "cpu_us_per_inference": cpu[config] / count * 1e6,
            "redis_us_per_inference": work[config][0] / count,
            "redis_commands_per_inference": work[config][1] / count,
        }
    return out


async def measure(
    services: Services, sizes: Sizes, repeats: int, configs: tuple[str, ...] = CONFIGS
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with RedisCluster() as cluster:
        for name, url in (("single", services.redis_url), ("cluster", cluster.url)):
            raw: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
            for _ in range(repeats):
                got = await _run(url, services.postgres_url, sizes, configs)
                for config in configs:
                    for stat, value in got[config].items():
                        raw[config].setdefault(stat, []).append(value)
            out[name] = {
                config: {stat: summary(values) for stat, values in stats.items()}
                for config, stats in raw.items()
            }
    return out


def each_table(results: dict[str, Any]) -> list[str]:
    """``--each``: what every feature alone adds to spend limits alone (medians of the runs)."""
    lines = [
        "| Redis | configuration | scripts / inference | Redis script µs / inference "
        "| added last-byte p50 µs | CPU µs / inference | CPU × spend alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in (("single", "one redis-server"), ("cluster", "3-master Cluster")):
        got = results[name]
        base = got["spend limits"]
        for config, stats in got.items():
            added = stats["p50_us"]["median"] - base["p50_us"]["median"]
            cpu = stats["cpu_us_per_inference"]["median"]
            lines.append(
                f"| {label} | {config} | {stats['scripts_per_inference']['median']:.1f} "
                f"| {stats['redis_us_per_inference']['median']:.0f} "
                f"| {'' if config == 'spend limits' else f'{added:+.0f}'} | {cpu:,.0f} "
                f"| {cpu / base['cpu_us_per_inference']['median']:.2f}× |"
            )
    return lines


def main() -> None:
    """``python -m benchmarks.features [--quick] [--repeat N] [--each] [--requests N]``:
    section 6 alone, printed; ``--each`` measures every request-path feature alone over spend
    limits alone; ``--requests`` sets the timed requests per configuration and run."""
    import asyncio
    import tempfile
    from contextlib import ExitStack
    from pathlib import Path

    from .report import features_section
    from .services import PrivatePostgres, PrivateRedis

    args = section_args(
        "python -m benchmarks.features",
        {"requests": "timed requests per configuration and run"},
        each="every feature alone, one by one",
    )
    sizes = Sizes.quick() if args.quick else Sizes.full()
    if args.requests:
        sizes = dataclasses.replace(sizes, inproc_inference=4 * args.requests)
    configs = EACH if args.each else CONFIGS
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sg-features-")))
        redis = stack.enter_context(PrivateRedis())
        pg = stack.enter_context(PrivatePostgres(args.postgres_url))
        services = Services(redis.url, pg.url, workdir)
        results = asyncio.run(measure(services, sizes, args.repeat, configs))
    print("\n".join(each_table(results) if args.each else features_section(results)))


if __name__ == "__main__":
    main()
