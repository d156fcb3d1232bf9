"""The benchmark suite at tiny sizes, so its code cannot rot: every section runs and reports.

No timing is asserted here (a shared CI box says nothing about speed); only that the run
completes and writes a JSON with every section filled with numbers, the Markdown table and the
chart. It needs redis-server and PostgreSQL like the rest of the suite: without them it skips
locally and FAILS under CI=true.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from spendguard.ledger.schema import records
from tests.support import ROOT, TemporaryDatabase
from tests.support.services import created_database, require_modules, unavailable
from tests.support.sql import sql_value

SECTIONS = (
    "machine",
    "inprocess",
    "alone",
    "routing",
    "http",
    "overshoot",
    "settlement",
    "peer",
    "redis_client_path",
    "features",
    "targets",
    "run",
)


def _require_services() -> None:
    require_modules("slowapi", "matplotlib")  # the benchmarks' peer limiter and chart
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not on PATH")
    created_database(TemporaryDatabase()).drop()  # the server is there and lets us create one


def _figures(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every min/median/max summary in a results tree, with where it is."""
    if isinstance(node, dict):
        if set(node) == {"min", "median", "max"}:
            return [(path, node)]
        out = []
        for key, value in node.items():
            out += _figures(value, f"{path}/{key}")
        return out
    if isinstance(node, list):
        return [f for i, item in enumerate(node) for f in _figures(item, f"{path}[{i}]")]
    return []


def _numbers(node: Any) -> list[float]:
    if isinstance(node, bool):
        return []
    if isinstance(node, int | float):
        return [float(node)]
    if isinstance(node, dict):
        return [n for v in node.values() for n in _numbers(v)]
    if isinstance(node, list):
        return [n for v in node for n in _numbers(v)]
    return []


@pytest.mark.timeout(300)
def test_quick_benchmark_run_writes_every_section(tmp_path: Path) -> None:
    _require_services()
    out = tmp_path / "results"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--quick",
            "--repeat",
            "1",
            "--out",
            str(out),
            # The fallback load generator: wrk may be installed here but not everywhere.
            "--loadgen",
            "asyncio",
        ],
        cwd=ROOT,
        env=dict(os.environ),  # SPENDGUARD_TEST_POSTGRES_URL names the server to use
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]

    results = json.loads((out / "results.json").read_text())
    for section in SECTIONS:
        assert section in results, section
        assert _numbers(results[section]), f"section {section} has no numbers"
    figures = _figures(results)
    assert len(figures) > 100
    for where, fig in figures:
        for stat, value in fig.items():
            assert isinstance(value, int | float) and math.isfinite(value), (where, stat, value)
    variants = {"bare", "embedded", "redis", "slowapi"}
    for route in ("inference", "health"):
        assert set(results["inprocess"]["routes"][route]) == variants
    assert set(results["inprocess"]["last_byte"]) == variants
    assert set(results["inprocess"]["records_aside"]) == {"embedded", "redis"}
    # The floor the Redis targets are read against: bare round trips cost time here too.
    floor = results["inprocess"]["floor"]
    assert set(floor) == {"one round trip", "two round trips"}
    assert floor["two round trips"]["added_p50_us"]["median"] > 0
    floors = {t["target"]: t["floor"] for t in results["targets"] if t["floor"] is not None}
    assert len(floors) == 2 and all(math.isfinite(f["median"]) for f in floors.values())
    assert set(results["inprocess"]["engine"]) == {"embedded", "redis"}
    alone = results["alone"]["cpu_us"]
    assert set(alone) == {"embedded", "redis"}
    for cases in alone.values():
        assert set(cases) == {"inference/1", "inference/64", "stream/64"}
        assert all(f["median"] > 0 for f in cases.values())
    routing = results["routing"]
    cases = routing["cases"]
    assert set(cases) == {
        "exact",
        "double_slash",
        "upper_case",
        "azure",
        "other_prefix",
        "unmatched_post",
        "get",
    }
    # What each table answered: every spelling and pattern matched by this release's table, the
    # previous one's matching the exact path only; no route for the non-inference requests.
    for case, f in cases.items():
        inference = case not in ("unmatched_post", "get")
        assert (f["new"]["matched"] is not None) == inference, (case, f["new"])
        assert (f["previous"]["matched"] is not None) == (case == "exact"), (case, f["previous"])
    assert "(model gpt-4o-mini)" in cases["azure"]["new"]["matched"]
    assert set(routing["safety_net_steps"]) == {
        "pass_route_lookup",
        "looks_like_inference",
        "json_loads",
    }
    assert set(routing["asgi"]) == {"inference", "inference_variant", "admin_post", "get"}
    for f in routing["asgi"].values():
        assert {"added_p50_us", "added_p99_us", "added_cpu_us_per_request"} <= set(f["embedded"])
        assert f["bare"]["cpu_us_per_request"]["median"] > 0
    repeats = results["run"]["repeats"]
    for route in ("health", "inference", "stream"):
        cells = results["http"]["routes"][route]
        assert set(cells) == {"1", "16", "64"}
        # The targets' cells (the highest concurrency) take more runs than the others.
        for conc, runs in (("1", repeats), ("64", repeats + results["http"]["extra_repeats"])):
            assert all(len(cells[conc][v]["runs"]) == runs for v in variants), (route, conc)
    assert results["http"]["extra_repeats"] > 0
    over = results["overshoot"]["variants"]
    assert set(over) == {"embedded", "redis", "embedded/hard", "redis/hard"}
    for variant in ("embedded/hard", "redis/hard"):  # a hard limit's spend never passes it
        # (More than k may be admitted: a request that ends early gives back the rest of its
        # hold, and the burst's later requests can use it.)
        for f in over[variant].values():
            assert f["spend_over_limit"]["max"] <= 1.0
    assert set(results["settlement"]["backends"]) == {"sqlite", "postgresql"}
    for redis in ("single", "cluster"):
        configs = results["features"][redis]
        assert set(configs) == {"spend limits", "alerts", "budgets", "everything"}
        # (Rounded: the records writer's carried writes, counted as a round of their own and
        # taken off, now and then leave in the same loop turn as a request's and share its
        # pipeline, which then reads as one round fewer in a block.)
        trips = {c: round(f["pipelines_per_inference"]["median"], 1) for c, f in configs.items()}
        scripts = {c: f["scripts_per_inference"]["median"] for c, f in configs.items()}
        # One round trip before the provider and one after, whatever is on: the budgets'
        # reserves and commits, and the provider lease and its settlement, ride in the spend
        # limits' pipeline writes; alerts ride the postflight.
        assert trips == dict.fromkeys(configs, 2), (redis, trips)
        # Budgets: the key's reserve (the model's and the global bucket's holds stocked
        # ahead), the key's commit, and a refill of the stock in both every fourth request;
        # the model's and the global bucket's commits are carried, every eighth finishing
        # round sending one call per bucket for eight requests (engine/carryover.py). A
        # block's last ones may leave after it (with the records writer, or in the next
        # block), uncounted in its own, and a block may carry the previous one's.
        # Everything adds the lease (its settlement carried too, one call per key).
        want = {"spend limits": 2, "alerts": 2, "budgets": 4.75, "everything": 5.875}
        assert all(abs(scripts[c] - want[c]) <= 0.5 for c in want), (redis, scripts)
        # The servers' own count: each script and the commands it runs. Per bucket (three,
        # of two windows each), a warm reserve runs 2 commands and one per window, a commit 3
        # and two per window: 13 with the two scripts, never a sorted set of expiries, a
        # lifetime renewal of every key or an increment per unit (the rare work, such as the
        # search for expired holds, averages well under one more).
        ran = {c: f["redis_commands_per_inference"]["median"] for c, f in configs.items()}
        assert all(ran[c] > scripts[c] for c in configs), (redis, ran)
        assert ran["budgets"] - ran["spend limits"] <= 3 * 13 + 1, (redis, ran)
    for target in results["targets"]:
        assert target["measured"] and isinstance(target["met"], bool), target

    table = (out / "results.md").read_text()
    assert "| target |" in table and "## 4. Settlement" in table
    assert "## 1b. spendguard alone" in table
    assert "## 1c. Route matching and the safety net" in table
    png = (out / "chart.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


WRK_OUTPUT = """\
Running 1s test @ http://127.0.0.1:8000/health
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    13.13ms    2.03ms  30.12ms   90.00%
    Req/Sec     4.60k   300.00     5.00k    80.00%
  Latency Distribution
     50%   13.13ms
     75%   14.00ms
     90%   15.20ms
     99%  850.00us
  4627 requests in 1.00s, 600.00KB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 27
Requests/sec:   4627.00
Transfer/sec:    600.00KB
"""


def test_wrk_output_is_parsed() -> None:
    from benchmarks.loadgen import parse_wrk

    result = parse_wrk(WRK_OUTPUT)
    assert result.requests == 4627 and result.seconds == 1.0
    assert result.p50_us == pytest.approx(13_130) and result.p99_us == pytest.approx(850)
    assert result.statuses == {"2xx": 4600, "non-2xx": 27} and result.ok == 4600
    assert result.errors == 3


def test_instruction_counts_workload_runs_and_reports(tmp_path: Path) -> None:
    # benchmarks/instructions.py runs this workload twice per variant under valgrind (minutes:
    # not for every CI run). Here it runs as is, so it cannot rot: the embedded gateway serves
    # its inferences and writes every record; and the report turns counts into the table.
    _require_services()
    from benchmarks import instructions

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--child",
            json.dumps(
                [
                    "embedded",
                    "inference",
                    30,
                    "redis://unused",
                    "postgresql://unused",
                    str(tmp_path / "child"),
                ]
            ),
        ],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    db = sqlite3.connect(tmp_path / "child" / "embedded.db")
    try:
        assert db.execute("SELECT count(*) FROM spendguard_records").fetchone() == (
            instructions.WARM + 30,
        )
    finally:
        db.close()
    table = instructions.report({"inference": {"bare": 2_000_000.0, "embedded": 2_500_000.0}})
    assert "| inference | embedded | 2,500,000 | 500,000 | 0.800 |" in table


def test_instruction_counts_of_a_feature_gateway_run_its_requests(
    tmp_path: Path, redis_url: str, clean_postgres_url: str
) -> None:
    # ``python -m benchmarks.instructions --features`` runs this under valgrind: section 6's
    # "everything" gateway, warmed as there, then WARM + n requests one at a time, each
    # admitted and charged (a record apiece in its ledger).
    from benchmarks import features, instructions
    from benchmarks.common import Sizes

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--child",
            json.dumps(
                [
                    instructions.FEATURES_PREFIX + "everything",
                    "inference",
                    7,
                    redis_url,
                    clean_postgres_url,
                    str(tmp_path / "child"),
                ]
            ),
        ],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    warm = max(20, Sizes.quick().inproc_warmup // 4)  # _prepared's own warm-up
    assert features.SETS["everything"] == frozenset(features.FEATURES)
    count = sa.select(sa.func.count()).select_from(records)
    assert anyio.run(sql_value, clean_postgres_url, count) == warm + instructions.WARM + 7
    table = instructions.features_report(
        {"one redis-server": {"spend limits": 4_000_000.0, "everything": 5_000_000.0}}
    )
    assert "| one redis-server | everything | 5,000,000 | 1.250× |" in table


@pytest.mark.anyio
async def test_each_feature_alone_turns_on_that_feature_only(
    redis_url: str, clean_postgres_url: str
) -> None:
    """``python -m benchmarks.features --each``: ten gateways, each spend limits plus one
    feature (or all of them), measured taking turns on one redis-server."""
    from benchmarks.common import Sizes
    from benchmarks.features import EACH, _run, each_table

    got = await _run(redis_url, clean_postgres_url, Sizes.quick(), EACH)
    assert tuple(got) == EACH
    # (At these sizes a gateway's one-off reads, such as a cache fill, show in the averages:
    # rounded, as the full run's medians are.)
    trips = {c: round(f["pipelines_per_inference"], 1) for c, f in got.items()}
    assert trips == dict.fromkeys(EACH, 2), trips
    scripts = {c: round(f["scripts_per_inference"], 1) for c, f in got.items()}
    # Only the budgets (the key's reserve, the model's and the global bucket's holds stocked
    # ahead, refilled in both every fourth request; the key's commit, the shared buckets'
    # carried, one call each per eight requests) and the provider pool (a lease, and its
    # settlement, carried: one call per key per eight requests) add scripts; the rest ride
    # the two the spend limits send, and read or write more in them. (A block's last carried
    # writes may leave after it, uncounted.)
    want = dict.fromkeys(EACH, 2.0)
    want |= {"budgets": 4.75, "provider pool": 3.125, "everything": 5.875}
    assert all(abs(scripts[c] - want[c]) <= 0.5 for c in EACH), scripts
    ran = {c: f["redis_commands_per_inference"] for c, f in got.items()}
    for config in ("hard limit", "balance", "rates"):  # a hold, the balance key, rate states
        assert ran[config] > ran["spend limits"], (config, ran)
    results = {"single": {c: {k: {"median": v} for k, v in f.items()} for c, f in got.items()}}
    results["cluster"] = results["single"]
    table = each_table(results)
    assert len(table) == 2 + 2 * len(EACH)
    assert table[2].startswith("| one redis-server | spend limits | 2.0 |")
