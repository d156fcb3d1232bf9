"""The hot-slot ceiling: how many admissions one shared budget bucket takes, and how to scale out.

    python -m benchmarks.hotslot [--quick] [--json FILE] [--seconds S] [--seeds N]

A shared bucket (a model's budget, the fleet's global budget, a provider-key pool) keeps all its
keys under one hash tag, so on Redis Cluster too it lives in ONE slot, on one node, and its
scripts run on that node's one command thread. This module measures that ceiling and simulates
three ways past it.

1. **Ceiling, measured** (needs ``redis-server`` on PATH): a private ``redis-server`` on a free
   loopback port (never a shared one) runs spendguard's scripts, loaded as spendguard loads
   them (a budget script is ``bucket_common.lua`` + ``bucket_<name>.lua``; the spend scripts
   are read as is),
   driven over several connections, each with a pipeline of calls in flight, so that the
   server's command thread, not the client, is the bottleneck. Scenarios:

   * ``admission``: the budget ``reserve`` then ``commit`` scripts on ONE bucket (the fleet's
     bucket in the shared ``{pool}`` slot: its holds hash and two window hashes, named as
     ``RedisStore.bucket_keys`` names them), one pair per admission; the windows are full (60
     slices each, tokens and cost) and 1,000 other holds are in flight, as on a busy bucket;
   * ``reserve only`` then ``commit only``: the same two scripts apart, to split the cost;
   * ``preflight``: the spend-limit ``preflight`` script on one team's keys (a key with a daily
     and a team with a monthly soft limit, the other candidates without policy, no rates, an
     admission entry written per call: the shipped defaults of a gateway with a heartbeat).

   Reported per run: executions/s, µs per execution (1/rate, wall), redis-server's CPU over the
   run (utime + stime from ``/proc/<pid>/stat``; 100 % = one core saturated), the client's CPU,
   and ``INFO commandstats``' ``usec_per_call`` of ``evalsha`` (the time inside the script,
   without the network and parsing around it).

2. **Scale-out, simulated** (pure Python, seeded, no Redis): 50 gateways share one bucket of
   ``L`` tokens; ``central``, ``leases`` (hard and soft, fixed and adaptive sizes) and
   ``sharded`` counters are compared on hot-slot calls per admission, admitted tokens against
   ``L`` and refusals while the bucket as a whole still had room.

Every load run is bounded in time (``--seconds``); ``--quick`` runs everything in a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .services import PrivateRedis

ROOT = Path(__file__).resolve().parents[1]
STORE_LUA = ROOT / "spendguard" / "store" / "lua"

PREFIX = "sg"
SLICES = 60  # spendguard/store/lua/bucket_common.lua
HIGH = 10**15  # limits no run reaches: every call is admitted


# ---------------------------------------------------------------------------------------------
# Scripts and keys, as spendguard builds them (read from the files, nothing imported)


def budget_lua(name: str) -> str:
    """``spendguard.store.redis._lua``: bucket_common.lua, a newline, then the script."""
    common = (STORE_LUA / "bucket_common.lua").read_text("utf-8")
    return common + "\n" + (STORE_LUA / f"bucket_{name}.lua").read_text("utf-8")


def store_lua(name: str) -> str:
    """``spendguard.store.redis._lua``: the file as is."""
    return (STORE_LUA / f"{name}.lua").read_text("utf-8")


@dataclasses.dataclass(frozen=True)
class Window:
    id: str
    seconds: int

    @property
    def slice_ms(self) -> int:
        return self.seconds * 1000 // SLICES


# budgets.yaml's example windows: a day and a 30-day month.
WINDOWS = (Window("daily", 86_400), Window("monthly", 30 * 86_400))
HOLD_MS = 900_000  # DEFAULT_HOLD_SECONDS
TTL_MS = max(w.seconds for w in WINDOWS) * 1000 + HOLD_MS


def bucket_keys(tag: str = "bg") -> list[str]:
    """``RedisStore.bucket_keys``: holds, one hash per window, in the shared slot."""
    base = f"{PREFIX}:{{pool}}:budget:{tag}"
    return [f"{base}:holds", *(f"{base}:w:{w.id}:{w.seconds}" for w in WINDOWS)]


def reserve_args(now_ms: int, hold_id: str, tokens: int, cost: int) -> list[str]:
    """``RedisStore.reserve_buckets``'s ARGV for one bucket with a token and a cost limit on
    each window (require_seed on, as with a ledger)."""
    args = [str(now_ms), hold_id, str(now_ms + HOLD_MS), str(tokens), str(cost), "1"]
    args += [str(TTL_MS), "1"]
    for w in WINDOWS:
        # slice, rolling bounds (the script's own), token, cost and request limits
        args += [str(w.slice_ms), "", "", str(HIGH), str(HIGH), "-"]
    return args


def commit_args(now_ms: int, hold_id: str, tokens: int, cost: int) -> list[str]:
    """``RedisStore.commit_buckets``'s ARGV: counted in the slice of the request's start."""
    args = [str(now_ms), str(TTL_MS), "1", hold_id, str(now_ms), str(tokens), str(cost)]
    return args + [x for w in WINDOWS for x in (str(w.slice_ms), "")]


TEAM, KEY = "acme", "alpha"


def _team_keys(now_ms: int) -> dict[str, str]:
    """One team's spend keys (``spendguard.limits.codec``): policy, usage, rates, entries."""
    day = time.strftime("%Y%m%d", time.gmtime(now_ms / 1000))
    month = day[:6]
    base = f"{PREFIX}:{{{TEAM}}}:spend"
    return {
        "policy": f"{base}:policy",
        "key_day": f"{base}:usage:api_key:{KEY}:day:{day}",
        "key_month": f"{base}:usage:api_key:{KEY}:month:{month}",
        "team_day": f"{base}:usage:team:day:{day}",
        "team_month": f"{base}:usage:team:month:{month}",
        "balance": f"{base}:balance",
        "rate_key": f"{base}:rate:api_key:{KEY}",
        "rate_team": f"{base}:rate:team",
        "open": f"{base}:open",
    }


def preflight_call(now_ms: int, record_id: str, entry: str) -> tuple[list[str], list[str]]:
    """``RedisStore.preflight``'s KEYS and ARGV for the plan ``KeyCodec.plan`` makes for a
    key of a team: five candidates (key day, key month, team day, team month, balance), the
    model-list fields, the rate fields and keys, then the entry."""
    k = _team_keys(now_ms)
    keys = [
        k["policy"],
        k["key_day"],
        k["key_month"],
        k["team_day"],
        k["team_month"],
        k["balance"],
        k["rate_key"],
        k["rate_team"],
        k["open"],
    ]
    fields = [f"api_key:{KEY}:day", f"api_key:{KEY}:month", "team:day", "team:month", "balance"]
    args = [str(len(fields)), *fields, record_id, "2000", "gpt-4o-mini"]
    args += ["allow:", f"allow:{KEY}", f"rate:{KEY}", "rate:"]
    args += [str(now_ms), "1200", "600000", entry]
    return keys, args


# ---------------------------------------------------------------------------------------------
# A private redis-server (like tests/support/redis.py, without importing the test suite, which
# imports spendguard): a child on a free 127.0.0.1 port, persisting nothing, killed with us.

HOST = "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# Load: raw RESP over asyncio streams, hiredis packing and parsing, one pipeline in flight per
# connection


def _now_ms() -> int:
    return int(time.time() * 1000)


Batch = list[bytes]
# Per connection: a function of the connection's index returning an iterator of batches (a
# batch is the packed commands of one pipeline) and a check of each reply (True: as expected).
Plan = Callable[[int], Iterator[Batch]]


def _ok_one(reply: Any) -> bool:
    return bool(reply == 1)


def _ok_reserved(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and reply[0] == 1


def _ok_preflight(reply: Any) -> bool:
    # Five candidates, five values each (limit, settled, pending, hard, own alert thresholds).
    return isinstance(reply, list) and len(reply) == 25


async def _drive(
    host: str, port: int, batches: Iterator[Batch], check: Callable[[Any], bool], deadline: float
) -> tuple[int, int]:
    import hiredis

    reader, writer = await asyncio.open_connection(host, port)
    parser = hiredis.Reader()
    done = bad = 0
    try:
        while time.perf_counter() < deadline:
            batch = next(batches, None)  # made only when it is sent
            if batch is None:
                break
            writer.write(b"".join(batch))
            want, got = len(batch), 0
            while got < want:
                data = await reader.read(1 << 17)
                if not data:
                    raise ConnectionError("redis-server closed the connection")
                parser.feed(data)
                while True:
                    reply = parser.gets()
                    if reply is False:
                        break
                    got += 1
                    if isinstance(reply, hiredis.ReplyError) or not check(reply):
                        bad += 1
            done += want
    finally:
        writer.close()
        await writer.wait_closed()
    return done, bad


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (fields 14 and 15 of /proc/<pid>/stat)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def _commandstats(client: Any) -> dict[str, dict[str, float]]:
    raw = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v for k, v in raw.items()}


def _load_run(
    server: Any,
    client: Any,
    plan: Plan,
    check: Callable[[Any], bool],
    connections: int,
    seconds: float,
) -> dict[str, Any]:
    client.config_resetstat()
    pid = server.pid
    tick = os.sysconf("SC_CLK_TCK")
    cpu0, self0, t0 = _cpu_ticks(pid), os.times(), time.perf_counter()

    async def main() -> list[tuple[int, int]]:
        deadline = time.perf_counter() + seconds
        return await asyncio.gather(
            *(
                _drive(server.host, server.port, plan(i), check, deadline)
                for i in range(connections)
            )
        )

    results = asyncio.run(main())
    wall = time.perf_counter() - t0
    cpu1, self1 = _cpu_ticks(pid), os.times()
    done = sum(r[0] for r in results)
    bad = sum(r[1] for r in results)
    stats = _commandstats(client).get("evalsha", {})
    client_cpu = (self1.user - self0.user) + (self1.system - self0.system)
    rate = done / wall
    server_cpu_s = (cpu1 - cpu0) / tick
    return {
        "connections": connections,
        "seconds": round(wall, 3),
        "executions": done,
        "errors": bad,
        "executions_per_s": round(rate),
        "us_per_execution": round(1e6 / rate, 2) if rate else None,
        "server_cpu_pct": round(100 * server_cpu_s / wall, 1),
        # The server's CPU per execution: what one core's ceiling is made of, steadier than the
        # wall figure when other processes take the server's core now and then.
        "server_cpu_us_per_execution": round(1e6 * server_cpu_s / done, 2) if done else None,
        "client_cpu_pct": round(100 * client_cpu / wall, 1),
        "evalsha_usec_per_call": stats.get("usec_per_call"),
        "evalsha_calls": stats.get("calls"),
    }


def _pack(sha: str, keys: Sequence[str], args: Sequence[str]) -> bytes:
    import hiredis

    # (hiredis's stub types the argument as a 1-tuple.)
    command: Any = ("EVALSHA", sha, str(len(keys)), *keys, *args)
    packed: bytes = hiredis.pack_command(command)
    return packed


def _prepare_bucket(client: Any, keys: Sequence[str], in_flight: int, full: bool = True) -> None:
    """A busy bucket: seeded, both windows full (``full``: 60 slices of tokens and of cost, as
    after a window of steady traffic), and ``in_flight`` holds of other requests that expire
    later than any run. ``full=False, in_flight=0``: a bucket seeded a moment ago."""
    client.delete(*keys)
    now = _now_ms()
    holds = keys[0]
    mapping: dict[str, str] = {"_seeded": "1"}
    for i in range(in_flight):
        mapping[f"other-{i}"] = f"{now + HOLD_MS} 1500 300"
    mapping["_t"] = str(1500 * in_flight)
    mapping["_c"] = str(300 * in_flight)
    mapping["_r"] = str(in_flight)
    mapping["_n"] = str(now + HOLD_MS)  # no hold expires during a run
    client.hset(holds, mapping=mapping)
    for key, w in zip(keys[1:], WINDOWS, strict=True):
        if not full:
            continue
        cur = now // w.slice_ms
        slices: dict[str, str] = {}
        for idx in range(cur - SLICES + 1, cur + 1):
            slices[f"t{idx}"] = "250000"
            slices[f"c{idx}"] = "50000"
        client.hset(key, mapping=slices)
    for key in keys:
        client.pexpire(key, TTL_MS)


def _prepare_team(client: Any) -> None:
    k = _team_keys(_now_ms())
    client.delete(*k.values())
    client.hset(
        k["policy"],
        mapping={"_loaded": "1", f"api_key:{KEY}:day": str(HIGH), "team:month": str(HIGH)},
    )
    for usage in ("key_day", "team_month"):
        client.hset(k[usage], mapping={"s": "123456789", "p": "0"})


def ceiling(
    seconds: float, repeats: int, connections: Sequence[int], pipeline: int, progress: Any
) -> dict[str, Any]:
    import redis

    server = PrivateRedis().start()
    assert server.pid is not None
    try:
        client = redis.Redis(host=server.host, port=server.port, decode_responses=True)
        shas = {
            "reserve": client.script_load(budget_lua("reserve")),
            "commit": client.script_load(budget_lua("commit")),
            "preflight": client.script_load(store_lua("preflight")),
        }
        keys = bucket_keys()
        info = client.info("server")
        out: dict[str, Any] = {
            "redis_server": info.get("redis_version"),
            "io_threads": client.config_get("io-threads").get("io-threads"),
            "cores": os.cpu_count(),
            "pipeline": pipeline,
            "seconds_per_run": seconds,
            "repeats": repeats,
            "bucket_keys": keys,
            "windows": [dataclasses.asdict(w) for w in WINDOWS],
            "scenarios": {},
        }

        def admission(conn: int) -> Iterator[Batch]:
            seq = 0
            pairs = max(1, pipeline // 2)
            while True:
                now = _now_ms()
                batch: Batch = []
                for _ in range(pairs):
                    hid = f"h{conn}-{seq}"
                    seq += 1
                    batch.append(_pack(shas["reserve"], keys, reserve_args(now, hid, 1500, 300)))
                    batch.append(_pack(shas["commit"], keys, commit_args(now, hid, 1200, 250)))
                yield batch

        def _check_admission(reply: Any) -> bool:
            return _ok_one(reply) or _ok_reserved(reply)

        reserved: dict[int, list[str]] = {}

        def reserve_only(conn: int) -> Iterator[Batch]:
            ids = reserved.setdefault(conn, [])
            while True:
                now = _now_ms()
                batch: Batch = []
                for _ in range(pipeline):
                    hid = f"r{conn}-{len(ids)}"
                    ids.append(hid)
                    batch.append(_pack(shas["reserve"], keys, reserve_args(now, hid, 1500, 300)))
                yield batch

        def commit_only(conn: int) -> Iterator[Batch]:
            ids = reserved.get(conn, [])
            for start in range(0, len(ids), pipeline):
                now = _now_ms()
                yield [
                    _pack(shas["commit"], keys, commit_args(now, hid, 1200, 250))
                    for hid in ids[start : start + pipeline]
                ]

        entry = json.dumps(
            {
                "o": "gw-0123456789abcdef",
                "t": "acme",
                "k": "alpha",
                "m": "gpt-4o-mini",
                "r": "/v1/chat/completions",
                "in": 800,
                "out": 1200,
            }
        )

        def preflight(conn: int) -> Iterator[Batch]:
            seq = 0
            while True:
                now = _now_ms()
                batch: Batch = []
                for _ in range(pipeline):
                    # Record ids cycle: the team's entries hash stays the size postflight and
                    # settlement keep it at, instead of growing with every call of the run.
                    rid = f"rec{conn}x{seq % 2000}"
                    seq += 1
                    k, a = preflight_call(now, rid, entry)
                    batch.append(_pack(shas["preflight"], k, a))
                yield batch

        def run(name: str, plan: Plan, check: Callable[[Any], bool], conns: int) -> None:
            progress(f"hotslot: {name}, {conns} connections x pipeline {pipeline}")
            row = _load_run(server, client, plan, check, conns, seconds)
            out["scenarios"].setdefault(name, []).append(row)

        # Warm-up: connections, the scripts' compiled functions, the allocator.
        _prepare_bucket(client, keys, 1000)
        _load_run(server, client, admission, _check_admission, 2, min(0.3, seconds))
        for _ in range(repeats):
            for conns in connections:
                _prepare_bucket(client, keys, 1000)
                run("admission", admission, _check_admission, conns)
            top = max(connections)
            _prepare_bucket(client, keys, 0, full=False)
            run("admission, fresh bucket", admission, _check_admission, top)
            _prepare_bucket(client, keys, 1000)
            reserved.clear()
            run("reserve only", reserve_only, _ok_reserved, top)
            # Every hold the reserve pass took, committed (a bounded count: it ends first).
            run("commit only", commit_only, _ok_one, top)
            _prepare_team(client)
            run("preflight", preflight, _ok_preflight, top)
        out["summary"] = _ceiling_summary(out["scenarios"], max(connections))
        client.close()
    finally:
        server.stop()
    return out


def _median(rows: Sequence[dict[str, Any]], field: str) -> float:
    values = [r[field] for r in rows if r.get(field) is not None]
    return float(statistics.median(values)) if values else float("nan")


def _ceiling_summary(scenarios: dict[str, list[dict[str, Any]]], top: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, rows in scenarios.items():
        at_top = [r for r in rows if r["connections"] == top] or rows
        rate = _median(at_top, "executions_per_s")
        row = {
            "executions_per_s": round(rate),
            "executions_per_s_min": min(r["executions_per_s"] for r in at_top),
            "executions_per_s_max": max(r["executions_per_s"] for r in at_top),
            "us_per_execution": round(1e6 / rate, 2) if rate else None,
            "evalsha_usec_per_call": _median(at_top, "evalsha_usec_per_call"),
            "server_cpu_pct": _median(at_top, "server_cpu_pct"),
            "server_cpu_us_per_execution": _median(at_top, "server_cpu_us_per_execution"),
            "client_cpu_pct": _median(at_top, "client_cpu_pct"),
            "errors": sum(r["errors"] for r in rows),
        }
        cpu_us = row["server_cpu_us_per_execution"]
        # At 100 % of one core: executions/s the server's own CPU cost allows.
        row["executions_per_s_at_one_core"] = round(1e6 / cpu_us) if cpu_us > 0 else None
        if name.startswith("admission"):
            row["admissions_per_s"] = round(rate / 2)
            row["us_per_admission"] = round(2e6 / rate, 2) if rate else None
            row["admissions_per_s_at_one_core"] = round(5e5 / cpu_us) if cpu_us > 0 else None
        summary[name] = row
    return summary


# ---------------------------------------------------------------------------------------------
# Scale-out, simulated


@dataclasses.dataclass(frozen=True)
class SimConfig:
    gateways: int = 50
    limit: int = 1_000_000  # tokens per window, the shared bucket's L
    seconds: float = 4.0  # simulated time: demand about twice L, so the limit is reached
    rate_min: float = 2.0  # requests/s per gateway, uniform in [rate_min, rate_max]
    rate_max: float = 40.0
    size_median: float = 300.0  # tokens per request: lognormal, clamped to [1, size_max]
    size_sigma: float = 1.0
    size_max: int = 8000
    lease_seconds: float = 1.0  # a lease's unused part goes back this long after its grant
    rebalance_seconds: float = 1.0  # sharded counters: how often free limit is pooled again


@dataclasses.dataclass(frozen=True)
class Request:
    t: float
    gateway: int
    size: int


def requests_for(cfg: SimConfig, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    for g in range(cfg.gateways):
        rate = rng.uniform(cfg.rate_min, cfg.rate_max)
        t = rng.expovariate(rate)
        while t < cfg.seconds:
            size = round(rng.lognormvariate(math.log(cfg.size_median), cfg.size_sigma))
            out.append(Request(t, g, min(cfg.size_max, max(1, size))))
            t += rng.expovariate(rate)
    out.sort(key=lambda r: (r.t, r.gateway))
    return out


class Outcome:
    """What one mode did with one request stream; ``used`` is the tokens admitted so far."""

    def __init__(self, cfg: SimConfig, requests: Sequence[Request]) -> None:
        self.cfg = cfg
        self.requests = len(requests)
        self.demand = sum(r.size for r in requests)
        self.used = 0
        self.admitted = 0
        self.refused = 0
        self.spurious = 0  # refused although used + size <= L: a central bucket admits it
        self.spurious_tokens = 0
        self.spurious_below_99 = 0  # ... while less than 99 % of L was used
        self.calls: dict[int, int] = {}  # slot -> calls on it
        self.calls_below_90: dict[int, int] = {}  # calls per slot while used < 90 % of L ...
        self.admitted_below_90 = 0  # ... and the admissions meanwhile
        self.max_over = 0
        self.first_refusal: float | None = None  # used / L when the first request was refused

    def call(self, slot: int = 0, n: int = 1) -> None:
        self.calls[slot] = self.calls.get(slot, 0) + n
        if self.used < 0.9 * self.cfg.limit:
            self.calls_below_90[slot] = self.calls_below_90.get(slot, 0) + n

    def admit(self, size: int) -> None:
        if self.used < 0.9 * self.cfg.limit:
            self.admitted_below_90 += 1
        self.used += size
        self.admitted += 1
        self.max_over = max(self.max_over, self.used - self.cfg.limit)

    def refuse(self, size: int) -> None:
        self.refused += 1
        if self.first_refusal is None:
            self.first_refusal = self.used / self.cfg.limit
        if self.used + size <= self.cfg.limit:
            self.spurious += 1
            self.spurious_tokens += size
            if self.used < 0.99 * self.cfg.limit:
                self.spurious_below_99 += 1

    def result(self) -> dict[str, Any]:
        hottest = max(self.calls.values(), default=0)
        lim = self.cfg.limit
        return {
            "hot_slot_calls_per_request": hottest / self.requests,
            "hot_slot_calls_per_admission": hottest / max(1, self.admitted),
            "hot_slot_calls_per_admission_below_90pct": max(self.calls_below_90.values(), default=0)
            / max(1, self.admitted_below_90),
            "admitted_over_limit": self.used / lim,
            "over_admission_tokens": max(0, self.max_over),
            "unused_at_end_tokens": max(0, lim - self.used),
            "used_at_first_refusal": 1.0 if self.first_refusal is None else self.first_refusal,
            "spurious_refusals": self.spurious,
            "spurious_refusals_pct_of_requests": 100 * self.spurious / self.requests,
            "spurious_refusals_pct_of_refusals": 100 * self.spurious / max(1, self.refused),
            "spurious_refused_tokens": self.spurious_tokens,
            "spurious_refusals_below_99pct": self.spurious_below_99,
        }


def sim_central(cfg: SimConfig, reqs: Sequence[Request]) -> Outcome:
    o = Outcome(cfg, reqs)
    for r in reqs:
        o.call()
        if o.used + r.size <= cfg.limit:
            o.admit(r.size)
        else:
            o.refuse(r.size)
    return o


def sim_leases(
    cfg: SimConfig,
    reqs: Sequence[Request],
    *,
    size: float,
    hard: bool = True,
    adaptive: bool = False,
) -> Outcome:
    """Leases of ``size`` × L carved from the shared bucket (one call each). A gateway admits
    locally against its lease; when a request does not fit (hard) or the lease is spent (soft),
    one call returns the rest (or charges the debt) and takes a new lease; a lease's rest also
    goes back (one call) ``lease_seconds`` after its grant. ``adaptive``: a lease is at most
    1/(2G) of what the bucket has free, and never less than the request (near the limit that is
    a central call per admission)."""
    o = Outcome(cfg, reqs)
    lim = cfg.limit
    top = max(1, int(size * lim))
    central = 0  # the bucket's count: consumed and returned, plus every outstanding lease
    lease = [0] * cfg.gateways  # what is left of each gateway's lease (soft: may be < 0)
    granted = [0.0] * cfg.gateways
    live = [False] * cfg.gateways
    expiries: list[tuple[float, int, float]] = []

    def give_back(g: int) -> None:
        nonlocal central
        central -= lease[g]  # a debt (soft) is charged: central grows by it
        lease[g] = 0
        live[g] = False

    for r in reqs:
        while expiries and expiries[0][0] <= r.t:
            _, g, at = heapq.heappop(expiries)
            if live[g] and granted[g] == at:
                o.call()
                give_back(g)
        g = r.gateway
        fits = r.size <= lease[g] if hard else lease[g] > 0
        if live[g] and fits:
            lease[g] -= r.size
            o.admit(r.size)
            continue
        # One call: give back the rest (or the debt), take a new lease.
        o.call()
        if live[g]:
            give_back(g)
        free = lim - central
        want = top
        if adaptive:
            want = min(top, free // (2 * cfg.gateways))
        want = max(want, r.size)
        grant = min(want, free)
        need = r.size if hard else 1
        if grant < need:
            o.refuse(r.size)
            continue
        central += grant
        lease[g], granted[g], live[g] = grant - r.size, r.t, True
        heapq.heappush(expiries, (r.t + cfg.lease_seconds, g, r.t))
        o.admit(r.size)
    return o


def sim_sharded(
    cfg: SimConfig,
    reqs: Sequence[Request],
    *,
    shards: int,
    rebalance: bool = False,
    second_try: bool = False,
) -> Outcome:
    """The bucket cut into ``shards`` counters of L/K, each in its own slot; a gateway
    reserves on the shard its id hashes to. ``rebalance``: every ``rebalance_seconds`` the free
    limit of all shards is withdrawn (one call per shard) and spread evenly again (the sum of
    shard limits never exceeds L). ``second_try``: a refused request tries the next shard."""
    o = Outcome(cfg, reqs)
    limits = [cfg.limit // shards] * shards
    limits[0] += cfg.limit - sum(limits)
    used = [0] * shards
    home = [zlib.crc32(f"gateway-{g}".encode()) % shards for g in range(cfg.gateways)]
    next_rebalance = cfg.rebalance_seconds
    for r in reqs:
        while rebalance and r.t >= next_rebalance:
            free = sum(limits) - sum(used)
            for k in range(shards):
                o.call(k)
                limits[k] = used[k] + free // shards + (free % shards if k == 0 else 0)
            next_rebalance += cfg.rebalance_seconds
        tries = [home[r.gateway]]
        if second_try:
            tries.append((home[r.gateway] + 1) % shards)
        for k in tries:
            o.call(k)
            if used[k] + r.size <= limits[k]:
                used[k] += r.size
                o.admit(r.size)
                break
        else:
            o.refuse(r.size)
    return o


Mode = tuple[str, str, Callable[[Sequence[Request]], Outcome]]


def _modes(cfg: SimConfig) -> list[Mode]:
    """(name, over-admission bound on paper, run)."""
    soft_bound = f"G×(max request−1) = {cfg.gateways * (cfg.size_max - 1):,}"
    modes: list[Mode] = [("central", "0", partial(sim_central, cfg))]
    for pct in (0.01, 0.005):
        modes.append((f"leases {pct:.1%}, hard", "0", partial(sim_leases, cfg, size=pct)))
        modes.append(
            (f"leases {pct:.1%}, soft", soft_bound, partial(sim_leases, cfg, size=pct, hard=False))
        )
    modes.append(
        ("leases ≤1%, adaptive, hard", "0", partial(sim_leases, cfg, size=0.01, adaptive=True))
    )
    fast = dataclasses.replace(cfg, lease_seconds=0.2)
    modes.append(
        (
            "leases ≤1%, adaptive, hard, returned after 0.2 s",
            "0",
            partial(sim_leases, fast, size=0.01, adaptive=True),
        )
    )
    k = 8
    modes.append((f"sharded K={k}, static", "0", partial(sim_sharded, cfg, shards=k)))
    modes.append(
        (f"sharded K={k}, rebalanced 1 s", "0", partial(sim_sharded, cfg, shards=k, rebalance=True))
    )
    modes.append(
        (
            f"sharded K={k}, rebalanced 1 s + 2nd shard",
            "0",
            partial(sim_sharded, cfg, shards=k, rebalance=True, second_try=True),
        )
    )
    return modes


def simulate(cfg: SimConfig, seeds: int) -> dict[str, Any]:
    streams = [requests_for(cfg, seed) for seed in range(1, seeds + 1)]
    out: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "seeds": seeds,
        "requests_per_seed": statistics.median(len(s) for s in streams),
        "demand_over_limit": statistics.median(sum(r.size for r in s) / cfg.limit for s in streams),
        "modes": [],
    }
    for name, bound, run in _modes(cfg):
        rows = [run(s).result() for s in streams]
        row: dict[str, Any] = {"mode": name, "over_admission_bound_tokens": bound}
        for field in rows[0]:
            values = [r[field] for r in rows]
            row[field] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        out["modes"].append(row)
    return out


# ---------------------------------------------------------------------------------------------
# Report


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    parts: list[str] = []
    c = results.get("ceiling")
    if c:
        parts.append(
            f"Ceiling: redis-server {c['redis_server']} (io-threads {c['io_threads']}), "
            f"{c['cores']} cores, pipeline {c['pipeline']}, {c['seconds_per_run']} s per run, "
            f"{c['repeats']} repeat(s)"
        )
        rows = []
        for name, runs in c["scenarios"].items():
            for r in runs:
                rows.append(
                    [
                        name,
                        r["connections"],
                        f"{r['executions_per_s']:,}",
                        r["us_per_execution"],
                        r["evalsha_usec_per_call"],
                        r["server_cpu_pct"],
                        r["server_cpu_us_per_execution"],
                        r["client_cpu_pct"],
                        r["errors"],
                    ]
                )
        head = [
            "scenario",
            "conns",
            "exec/s",
            "µs/exec (wall)",
            "evalsha usec_per_call",
            "server CPU %",
            "server CPU µs/exec",
            "client CPU %",
            "errors",
        ]
        parts.append(_table(head, rows))
        s = c["summary"]
        srows = [
            [
                name,
                f"{v['executions_per_s']:,} ({v['executions_per_s_min']:,}–"
                f"{v['executions_per_s_max']:,})",
                v["us_per_execution"],
                v["evalsha_usec_per_call"],
                v["server_cpu_pct"],
                v["server_cpu_us_per_execution"],
                f"{v['executions_per_s_at_one_core']:,}",
            ]
            for name, v in s.items()
        ]
        head = [
            "scenario",
            "exec/s median (min–max)",
            "µs/exec",
            "usec_per_call",
            "server CPU %",
            "server CPU µs/exec",
            "exec/s at 100% of a core",
        ]
        parts.append(_table(head, srows))
        for name in ("admission", "admission, fresh bucket"):
            if name in s:
                a = s[name]
                parts.append(
                    f"=> {name}: {a['admissions_per_s']:,} admissions/s (reserve+commit) through "
                    f"one shared bucket on one core, {a['us_per_admission']} µs each "
                    f"({a['admissions_per_s_at_one_core']:,}/s at 100% of the core)"
                )
    sim = results.get("simulation")
    if sim:
        cfg = sim["config"]
        parts.append(
            f"Simulation: {cfg['gateways']} gateways, L = {cfg['limit']:,} tokens, "
            f"{sim['seeds']} seeds, ~{sim['requests_per_seed']:,.0f} requests and "
            f"{sim['demand_over_limit']:.2f}×L demand per seed in {cfg['seconds']} s"
        )
        rows = []
        for m in sim["modes"]:
            rows.append(
                [
                    m["mode"],
                    f"{m['hot_slot_calls_per_admission_below_90pct']['median']:.3f}",
                    f"{m['hot_slot_calls_per_request']['median']:.3f}",
                    f"{m['admitted_over_limit']['median']:.4f} / "
                    f"{m['admitted_over_limit']['max']:.4f}",
                    f"{m['over_admission_tokens']['max']:,}",
                    m["over_admission_bound_tokens"],
                    f"{m['used_at_first_refusal']['min']:.1%}",
                    f"{m['spurious_refusals']['median']:,.0f} / {m['spurious_refusals']['max']:,}"
                    f" ({m['spurious_refusals_pct_of_requests']['median']:.1f}%)",
                    f"{m['spurious_refusals_below_99pct']['median']:,.0f} / "
                    f"{m['spurious_refusals_below_99pct']['max']:,}",
                ]
            )
        head = [
            "mode",
            "hot-slot calls/admission (<90% L)",
            "hot-slot calls/request (all)",
            "admitted/L median / max",
            "over-admission max (tokens)",
            "bound on paper",
            "used at 1st refusal (min)",
            "spurious refusals median / max (% of requests)",
            "spurious while used < 99% L, median / max",
        ]
        parts.append(_table(head, rows))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotslot", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seconds", type=float, help="per load run (default 3, quick 0.4)")
    parser.add_argument("--repeat", type=int, help="repeats of each load run (3, quick 1)")
    parser.add_argument("--seeds", type=int, help="simulation seeds (20, quick 3)")
    parser.add_argument("--pipeline", type=int, default=50, help="calls per pipeline")
    parser.add_argument("--no-redis", action="store_true", help="the simulation only")
    args = parser.parse_args(argv)
    seconds = args.seconds or (0.4 if args.quick else 3.0)
    repeats = args.repeat or (1 if args.quick else 3)
    seeds = args.seeds or (3 if args.quick else 20)
    connections = (1, 8) if args.quick else (1, 2, 4, 8, 16)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results: dict[str, Any] = {"quick": bool(args.quick)}
    if not args.no_redis:
        results["ceiling"] = ceiling(seconds, repeats, connections, args.pipeline, progress)
    progress("hotslot: simulation")
    results["simulation"] = simulate(SimConfig(), seeds)
    print(render(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
