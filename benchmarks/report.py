"""The outputs of a run: targets judged from the measured medians, a Markdown report, a chart.

Nothing here measures; it only reads the results dict the measurements produced in this run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .apps import LABELS, VARIANTS

# Where targets are judged: the throughput ones at the highest concurrency measured, settlement
# at spendguard's default batch size (SPENDGUARD_SETTLE_BATCH).
DEFAULT_SETTLE_BATCH = "1000"


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    goal: float
    higher_is_better: bool
    unit: str
    path: tuple[str, ...]  # where the figure lives in the results
    # Where the same figure of the floor lives (Redis round trips with none of spendguard's
    # code, inprocess.py): what no client could go below on this machine.
    floor: tuple[str, ...] | None = None


def _get(results: dict[str, Any], path: tuple[str, ...]) -> dict[str, float] | None:
    node: Any = results
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) and "median" in node else None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    top = str(max(int(c) for c in results["http"]["routes"]["health"]))
    batch = DEFAULT_SETTLE_BATCH
    if batch not in results["settlement"]["backends"]["postgresql"]["settle_records_per_s"]:
        batch = max(results["settlement"]["backends"]["postgresql"]["settle_records_per_s"])
    http = ("http", "routes")
    inf = ("inprocess", "routes", "inference")
    specs = [
        Target(
            f"Non-inference route, embedded store: HTTP throughput, concurrency {top} ≥ 0.99× bare",
            0.99, True, "×", (*http, "health", top, "embedded", "rps_ratio"),
        ),
        Target(
            f"Non-inference route, Redis store: HTTP throughput, concurrency {top} ≥ 0.99× bare",
            0.99, True, "×", (*http, "health", top, "redis", "rps_ratio"),
        ),
        Target(
            f"Inference route, embedded store: HTTP throughput, concurrency {top} ≥ 0.85× bare",
            0.85, True, "×", (*http, "inference", top, "embedded", "rps_ratio"),
        ),
        Target(
            f"Streamed inference, embedded store: HTTP throughput, concurrency {top} ≥ 0.85× bare",
            0.85, True, "×", (*http, "stream", top, "embedded", "rps_ratio"),
        ),
        Target(
            f"Inference route, Redis store: HTTP throughput, concurrency {top} ≥ 0.85× bare",
            0.85, True, "×", (*http, "inference", top, "redis", "rps_ratio"),
        ),
        Target(
            f"Streamed inference, Redis store: HTTP throughput, concurrency {top} ≥ 0.85× bare",
            0.85, True, "×", (*http, "stream", top, "redis", "rps_ratio"),
        ),
        Target(
            f"Inference route, embedded store: ≤ 200 µs added server CPU per inference "
            f"(HTTP, concurrency {top})",
            200, False, "µs", (*http, "inference", top, "embedded", "added_cpu_us_per_request"),
        ),
        Target(
            f"Inference route, Redis store: ≤ 250 µs added server CPU per inference "
            f"(HTTP, concurrency {top})",
            250, False, "µs", (*http, "inference", top, "redis", "added_cpu_us_per_request"),
        ),
        Target(
            "Inference route, Redis store: ≤ 1.5 ms added p99 of the whole ASGI call in-process",
            1500, False, "µs", (*inf, "redis", "added_p99_us"),
            ("inprocess", "floor", "two round trips", "added_p99_us"),
        ),
        Target(
            "Inference route, Redis store: ≤ 300 µs added p50 to the last response byte "
            "in-process (one request at a time)",
            300, False, "µs", ("inprocess", "last_byte", "redis", "added_p50_us"),
            ("inprocess", "floor", "one round trip", "last_byte_added_p50_us"),
        ),
        Target(
            f"Settlement on PostgreSQL, one worker (batch {batch}): ≥ 20,000 records/s",
            20_000, True, "records/s",
            ("settlement", "backends", "postgresql", "settle_records_per_s", batch),
        ),
    ]  # fmt: skip
    out = []
    for t in specs:
        figure = _get(results, t.path)
        median = figure["median"] if figure else math.nan
        # The goal lies inside the spread of the repeats: this run cannot really tell.
        spread = figure is not None and figure["min"] <= t.goal <= figure["max"]
        met = (median >= t.goal) if t.higher_is_better else (median <= t.goal)
        out.append(
            {
                "target": t.name,
                "goal": t.goal,
                "unit": t.unit,
                "measured": figure,
                "met": bool(figure is not None and met),
                "within_spread": bool(spread),
                "floor": _get(results, t.floor) if t.floor else None,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt(value: float, digits: int = 0) -> str:
    if math.isnan(value):
        return "n/a"
    if abs(value) >= 10_000 and digits == 0:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _cell(figure: dict[str, float] | None, digits: int = 0, scale: float = 1.0) -> str:
    """median, with min–max of the repeats when they differ."""
    if not figure:
        return "n/a"
    lo, mid, hi = (figure[k] * scale for k in ("min", "median", "max"))
    if _fmt(lo, digits) == _fmt(hi, digits):
        return _fmt(mid, digits)
    return f"{_fmt(mid, digits)} ({_fmt(lo, digits)}–{_fmt(hi, digits)})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    run, machine = results["run"], results["machine"]
    lines = [
        "# spendguard benchmark results",
        "",
        f"`{run['command']}`: {run['repeats']} repeats, {run['seconds']:.0f} s, "
        f"{run['finished']}. Every cell is the median of the repeats, with (min–max) when "
        "they differ; every ratio is to the bare app measured in the same run.",
        "",
        "Machine: "
        + machine["summary"]
        + ". Load average (1, 5, 15 min) at the start "
        + ", ".join(f"{x:.2f}" for x in machine["load_average_at_start"])
        + "; at the end "
        + ", ".join(f"{x:.2f}" for x in machine.get("load_average_at_end", []))
        + ".",
        "",
        "## Targets",
        "",
    ]
    rows = []
    for t in results["targets"]:
        digits = 2 if t["unit"] == "×" else 0
        rows.append(
            [
                t["target"],
                _cell(t["measured"], digits) + ("" if t["unit"] == "×" else f" {t['unit']}"),
                ("**met**" if t["met"] else "**missed**")
                + (" (the goal is within the repeats' spread)" if t["within_spread"] else ""),
                f"{_cell(t['floor'])} {t['unit']}" if t.get("floor") else "",
            ]
        )
    lines += _table(["target", "measured (median, min–max)", "", "floor on this machine"], rows)
    lines += [
        "The floor: the same figure for bare Redis round trips with none of spendguard's code "
        '(section 1, "The floor"): one PING before the bare app for the last byte, a PING '
        "before and after the embedded store's gateway for the whole call. A goal below its "
        "floor cannot be met on this machine by any Redis client.",
        "",
    ]

    lines += [
        "## 1. In-process overhead (raw ASGI calls, per request, µs)",
        "",
    ]
    rows = []
    for route, variants in results["inprocess"]["routes"].items():
        for v in VARIANTS:
            f = variants[v]
            rows.append(
                [
                    route,
                    LABELS[v],
                    _cell(f["p50_us"]),
                    _cell(f["p99_us"]),
                    "—" if v == "bare" else _cell(f["added_p50_us"]),
                    "—" if v == "bare" else _cell(f["added_p99_us"]),
                    _cell(f["p50_ratio"], 2),
                ]
            )
    lines += _table(
        ["route", "variant", "p50", "p99", "added p50", "added p99", "p50 / bare"], rows
    )
    inf = results["inprocess"]["routes"]["inference"]
    lines += [
        "Where it goes. The inference route again with spendguard's record writer out of the "
        "way (records kept aside, written between blocks), next to the normal run (µs):",
        "",
    ]
    rows = [
        [
            LABELS[v],
            _cell(inf[v]["added_p50_us"]),
            _cell(f["added_p50_us"]),
            _cell(inf[v]["added_p99_us"]),
            _cell(f["added_p99_us"]),
        ]
        for v, f in results["inprocess"]["records_aside"].items()
    ]
    lines += _table(
        [
            "variant",
            "added p50",
            "added p50, records aside",
            "added p99",
            "added p99, records aside",
        ],
        rows,
    )
    lines += [
        "What a client waits for: request start to the last response byte. spendguard's "
        "postflight runs after it (still inside the ASGI call timed above) (µs):",
        "",
    ]
    rows = [
        [LABELS[v], _cell(f["p50_us"]), _cell(f["added_p50_us"]), _cell(f["added_p99_us"])]
        for v, f in results["inprocess"]["last_byte"].items()
        if v != "bare"
    ]
    lines += _table(["variant", "p50", "added p50", "added p99"], rows)
    floor = results["inprocess"].get("floor", {})
    lines += [
        "The floor: bare Redis round trips (the minimal hiredis client's PING to the same "
        "redis-server) with none of spendguard's code. *One round trip*: before the bare "
        "app, as a Redis store must ask before admitting. *Two round trips*: before and after "
        "the embedded store's gateway, the Redis store's two scripts on the embedded store's "
        "code. Added to the bare app, as above (µs):",
        "",
    ]
    rows = [
        [
            name,
            _cell(f["added_p50_us"]),
            _cell(f["added_p99_us"]),
            _cell(f["last_byte_added_p50_us"]),
            _cell(f["last_byte_added_p99_us"]),
        ]
        for name, f in floor.items()
    ]
    lines += _table(
        [
            "floor",
            "whole call added p50",
            "added p99",
            "last byte added p50",
            "added p99",
        ],
        rows,
    )
    lines += [
        "The engine alone: `SpendGuard.preflight` and `SpendGuard.postflight` called directly "
        "on the same warm guards, records written aside (µs):",
        "",
    ]
    rows = [
        [
            LABELS[v],
            _cell(f["preflight_p50_us"]),
            _cell(f["preflight_p99_us"]),
            _cell(f["postflight_p50_us"]),
            _cell(f["postflight_p99_us"]),
        ]
        for v, f in results["inprocess"]["engine"].items()
    ]
    lines += _table(
        ["variant", "preflight p50", "preflight p99", "postflight p50", "postflight p99"], rows
    )

    alone = results.get("alone")
    if alone is not None:
        lines += [
            "## 1b. spendguard alone (CPU per inference, µs)",
            "",
            "The middleware over an app that replays a recorded provider response at once "
            f"({alone['requests']} inferences per cell): nothing runs but spendguard, its "
            "record writes included.",
            "",
        ]
        rows = [
            [LABELS[v], *(_cell(cases[c], 1) for c in ("inference/1", "inference/64", "stream/64"))]
            for v, cases in alone["cpu_us"].items()
        ]
        lines += _table(["variant", "inference, c=1", "inference, c=64", "stream, c=64"], rows)

    routing = results.get("routing")
    if routing is not None:
        lines += routing_section(routing)

    http = results["http"]
    http_extra = http.get("extra_repeats", 0)
    lines += [
        f"## 2. HTTP, uvicorn one worker (load: {http['tool']})",
        "",
        "requests/s count 2xx answers only; CPU is the server process's CPU time per request. "
        f"The cells at the highest concurrency (the targets') take {http_extra} more runs than "
        "the others.",
        "",
    ]
    rows = []
    for route, by_conc in http["routes"].items():
        for conc, variants in by_conc.items():
            for v in VARIANTS:
                f = variants[v]
                rows.append(
                    [
                        route,
                        conc,
                        LABELS[v],
                        _cell(f["rps"]),
                        _cell(f["rps_ratio"], 2),
                        _cell(f["p50_us"], 2, 1e-3),
                        _cell(f["p99_us"], 2, 1e-3),
                        _cell(f["cpu_us_per_request"]),
                        str(f["non_2xx"] + f["errors"]),
                    ]
                )
    lines += _table(
        [
            "route",
            "conc.",
            "variant",
            "req/s",
            "× bare",
            "p50 ms",
            "p99 ms",
            "CPU µs/req",
            "non-2xx",
        ],
        rows,
    )

    over = results["overshoot"]
    lines += [
        "## 3. Overshoot (N concurrent requests, remaining budget covers k)",
        "",
        f"One request costs {over['request_cost_micros']} micro-USD. Spend is the period's "
        "total after the burst, as a multiple of the limit (1.00 = held exactly).",
        "",
    ]
    rows = []
    for label, per_n in over["variants"].items():
        v, _, mode = label.partition("/")
        for f in per_n.values():
            rows.append(
                [
                    f"{LABELS[v]}, {mode or 'soft'}",
                    str(f["n"]),
                    str(f["k"]),
                    _cell(f["admitted"]),
                    _cell(f["refused"]),
                    _cell(f["unavailable"]),
                    _cell(f["other"]),
                    _cell(f["spend_over_limit"], 2),
                ]
            )
    lines += _table(["variant", "N", "k", "admitted", "429", "503", "other", "spend / limit"], rows)
    if "worst_case_micros" in over:
        lines += [
            f"A hard limit holds each request's worst case ({over['worst_case_micros']} "
            "micro-USD) from admission to its end; its remaining budget covers k worst cases, "
            "so at most k run at once and its spend never passes the limit.",
            "",
        ]

    settle = results["settlement"]
    lines += ["## 4. Settlement and record writes (records/s)", ""]
    batches = list(next(iter(settle["backends"].values()))["settle_records_per_s"])
    rows = []
    for backend, f in settle["backends"].items():
        rows.append(
            [
                backend,
                _cell(f["record_writes_per_s"]),
                _cell(f.get("executemany_writes_per_s")),
                *(_cell(f["settle_records_per_s"][b]) for b in batches),
            ]
        )
    lines += _table(
        [
            "ledger",
            "record writes (Ledger.insert_records, batches of 500)",
            "same rows, asyncpg executemany",
            *(f"settle, batch {b}" for b in batches),
        ],
        rows,
    )
    lines += [
        "CPU of the writing process per record written with `Ledger.insert_records` (µs): "
        "the gateway's record writer takes this from the event loop that serves requests.",
        "",
    ]
    sizes = list(next(iter(settle["backends"].values()))["record_write_cpu_us"])
    rows = [
        [backend, *(_cell(f["record_write_cpu_us"][s]) for s in sizes)]
        for backend, f in settle["backends"].items()
    ]
    lines += _table(["ledger", *sizes], rows)
    workers = settle.get("postgresql_workers", {})
    if workers:
        lines += [
            "Worker processes racing over the same unsettled records on PostgreSQL (each its "
            "own `Ledger`), every record charged once:",
            "",
        ]
        rows = [
            [n, _cell(f["records_per_s"]), _cell(f["cpu_us_per_record"], 1)]
            for n, f in workers.items()
        ]
        lines += _table(["workers", "records/s settled", "worker CPU µs per record"], rows)
    lines += ["Redis preflight script (`RedisStore.preflight`), per call:", ""]
    rows = [
        [label, _cell(f["p50_us"]), _cell(f["p99_us"])]
        for label, f in settle["redis_preflight"].items()
    ]
    lines += _table(["load", "p50 µs", "p99 µs"], rows)

    peer = results["peer"]
    lines += [
        "## 5. The peer: slowapi with its Redis storage vs spendguard's Redis path",
        "",
    ]
    rows = [
        [
            row["figure"],
            _cell(row["spendguard_redis"], row["digits"]),
            _cell(row["slowapi"], row["digits"]),
        ]
        for row in peer["rows"]
    ]
    lines += _table(["figure", "spendguard, Redis store", "slowapi (Redis storage)"], rows)

    client = results["redis_client_path"]
    lines += [
        "## Redis client path: one preflight EVALSHA at each layer",
        "",
    ]
    rows = [
        [label, _cell(f["p50_us"]), _cell(f["p99_us"]), _cell(f["calls_per_s"])]
        for label, f in client.items()
    ]
    lines += _table(["client", "p50 µs", "p99 µs", "calls/s"], rows)

    features = results.get("features")
    if features:
        lines += features_section(features)
    return "\n".join(lines)


def features_section(features: dict[str, Any]) -> list[str]:
    """Section 6 (benchmarks/features.py), also printed by ``python -m benchmarks.features``."""
    lines: list[str] = [
        "## 6. Features on (Redis, in process, one request at a time)",
        "",
        "Per inference on warm caches: pipelines sent to Redis (sequential round trips) and "
        "the script calls they carry, the Redis servers' time in those scripts and the commands "
        "they ran (every node; a script's inner calls count), p50 time to the last response "
        "byte, and "
        "this process's CPU (gateway and upstream); the ratios are to spend limits alone.",
        "",
    ]
    rows: list[list[str]] = []
    for name, configs in features.items():
        base = configs.get("spend limits", {}).get("p50_us")
        base_cpu = configs.get("spend limits", {}).get("cpu_us_per_inference")
        for config, f in configs.items():
            alone = config == "spend limits"
            added = f"{f['p50_us']['median'] - base['median']:.0f}" if base and not alone else "—"
            ratio = (
                f"{f['cpu_us_per_inference']['median'] / base_cpu['median']:.2f}×"
                if base_cpu and not alone
                else "—"
            )
            scripts = f.get("scripts_per_inference")
            server_us = f.get("redis_us_per_inference")
            commands = f.get("redis_commands_per_inference")
            rows.append(
                [
                    "one redis-server" if name == "single" else "3-master Redis Cluster",
                    config,
                    _cell(f["pipelines_per_inference"], 1),
                    _cell(scripts, 1) if scripts else "—",
                    _cell(server_us) if server_us else "—",
                    _cell(commands, 1) if commands else "—",
                    _cell(f["p50_us"]),
                    added,
                    _cell(f["cpu_us_per_inference"]),
                    ratio,
                ]
            )
    lines += _table(
        [
            "Redis",
            "configuration",
            "pipelines / inference",
            "scripts / inference",
            "Redis script µs / inference",
            "Redis commands / inference",
            "last-byte p50 µs",
            "added p50 µs",
            "CPU µs / inference",
            "CPU × spend alone",
        ],
        rows,
    )
    return lines


def routing_section(routing: dict[str, Any]) -> list[str]:
    """Section 1c (benchmarks/routing.py), also printed by ``python -m benchmarks.routing``."""
    routes = routing["routes"]
    lines = [
        "## 1c. Route matching and the safety net",
        "",
        f"`RouteTable.match` per call (ns) on the default table ({routes['new']} routes) and "
        f"on the previous release's ({routes['previous']} exact paths), median of "
        f"{routing['batches']} batches of {routing['calls_per_batch']} calls per repeat, taking "
        'turns; "matched as" is what each table answered (—: no inference route).',
        "",
    ]
    rows = [
        [
            f["label"],
            f"`{f['method']} {f['path']}`",
            _cell(f["new"]["ns"]),
            f["new"]["matched"] or "—",
            _cell(f["previous"]["ns"]),
            f["previous"]["matched"] or "—",
            _cell(f["ratio"], 2),
        ]
        for f in routing["cases"].values()
    ]
    lines += _table(
        ["request", "", "this release", "matched as", "previous release", "matched as", "× prev."],
        rows,
    )
    steps = routing["safety_net_steps"]
    lines += [
        "The safety net's own steps on an unmatched POST, per call (ns): the pass-route "
        f"lookup, then the {routing['body_bytes']}-byte JSON body inspected (and, of that, "
        "`json.loads` alone).",
        "",
    ]
    lines += _table(
        ["pass-route lookup", "`looks_like_inference`", "`json.loads`"],
        [
            [
                _cell(steps[k]["ns"])
                for k in ("pass_route_lookup", "looks_like_inference", "json_loads")
            ]
        ],
    )
    lines += [
        "Through the ASGI stack (the benchmark gateway in process, as in section 1): the bare "
        "app and the same app with spendguard on the embedded store; CPU is this process's per "
        "request, the record writer's included (µs):",
        "",
    ]
    rows = []
    for f in routing["asgi"].values():
        bare, mine = f["bare"], f["embedded"]
        rows.append(
            [
                f["label"],
                f"`{f['method']} {f['path']}`",
                _cell(bare["p50_us"]),
                _cell(mine["added_p50_us"]),
                _cell(mine["added_p99_us"]),
                _cell(bare["cpu_us_per_request"]),
                _cell(mine["added_cpu_us_per_request"]),
            ]
        )
    lines += _table(
        ["request", "", "bare p50", "added p50", "added p99", "bare CPU", "added CPU"], rows
    )
    return lines


def peer_rows(results: dict[str, Any]) -> dict[str, Any]:
    """Section 5: the peer's figures next to spendguard's Redis path (all measured above)."""
    top = str(max(int(c) for c in results["http"]["routes"]["inference"]))
    inf = results["inprocess"]["routes"]["inference"]
    rows = [
        ("in-process added p50, µs", inf, "added_p50_us", 0),
        ("in-process added p99, µs", inf, "added_p99_us", 0),
    ]
    out = []
    for label, src, key, digits in rows:
        out.append(
            {
                "figure": label,
                "spendguard_redis": src["redis"][key],
                "slowapi": src["slowapi"][key],
                "digits": digits,
            }
        )
    for route in ("inference", "stream", "health"):
        f = results["http"]["routes"][route][top]
        out.append(
            {
                "figure": f"HTTP {route}, concurrency {top}: throughput × bare",
                "spendguard_redis": f["redis"]["rps_ratio"],
                "slowapi": f["slowapi"]["rps_ratio"],
                "digits": 2,
            }
        )
        out.append(
            {
                "figure": f"HTTP {route}, concurrency {top}: added CPU µs per request",
                "spendguard_redis": f["redis"]["added_cpu_us_per_request"],
                "slowapi": f["slowapi"]["added_cpu_us_per_request"],
                "digits": 0,
            }
        )
    return {"rows": out}


# ---------------------------------------------------------------------------------------------
# Chart


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = {"bare": "#888888", "embedded": "#1f77b4", "redis": "#d62728", "slowapi": "#2ca02c"}

    ax = axes[0][0]
    inf = results["inprocess"]["routes"]["inference"]
    shown = [v for v in VARIANTS if v != "bare"]
    x = range(len(shown))
    p50 = [inf[v]["added_p50_us"]["median"] for v in shown]
    p99 = [inf[v]["added_p99_us"]["median"] for v in shown]
    ax.bar([i - 0.2 for i in x], p50, 0.4, label="added p50", color=[colors[v] for v in shown])
    ax.bar([i + 0.2 for i in x], p99, 0.4, label="added p99", color=[colors[v] for v in shown],
           alpha=0.45)  # fmt: skip
    ax.axhline(50, ls=":", color=colors["embedded"], label="goal p50, embedded (50 µs)")
    ax.axhline(300, ls="--", color=colors["redis"], label="goal p50, Redis (300 µs)")
    ax.set_xticks(list(x), [LABELS[v] for v in shown], fontsize=8)
    ax.set_ylabel("µs added per request vs bare")
    ax.set_title("1. In-process overhead, inference route")
    ax.legend(fontsize=7)

    ax = axes[0][1]
    routes = results["http"]["routes"]
    concs = [int(c) for c in routes["inference"]]
    for v in VARIANTS:
        if v == "bare":
            continue
        for route, style in (("inference", "-o"), ("stream", "--s"), ("health", ":^")):
            ys = [routes[route][str(c)][v]["rps_ratio"]["median"] for c in concs]
            ax.plot(concs, ys, style, color=colors[v], label=f"{LABELS[v]}, {route}")
    ax.axhline(1.0, color="#888888", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("throughput × bare")
    ax.set_title(f"2. HTTP throughput vs bare ({results['http']['tool']})")
    ax.legend(fontsize=6, ncol=2)

    ax = axes[1][0]
    over = results["overshoot"]["variants"]
    for label, per_n in over.items():
        v, _, mode = label.partition("/")
        ns = [f["n"] for f in per_n.values()]
        ys = [f["spend_over_limit"]["median"] for f in per_n.values()]
        style = "--s" if mode else "-o"
        ax.plot(ns, ys, style, color=colors[v], label=f"{LABELS[v]}, {mode or 'soft'}")
        for n, y, f in zip(ns, ys, per_n.values(), strict=True):
            if f["unavailable"]["median"]:  # refused with a 503, not by the limit
                text = f"{f['unavailable']['median']:.0f} × 503"
                ax.annotate(text, (n, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.axhline(1.0, color="#888888", lw=0.8, label="limit")
    ax.set_xscale("log")
    ax.set_xlabel("N concurrent requests (budget covers N/10)")
    ax.set_ylabel("spend / limit")
    ax.set_title("3. Overshoot")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    settle = results["settlement"]["backends"]
    for backend, f in settle.items():
        bs = [int(b) for b in f["settle_records_per_s"]]
        ys = [f["settle_records_per_s"][str(b)]["median"] for b in bs]
        ax.plot(bs, ys, "-o", label=f"settle, {backend}")
        ax.axhline(f["record_writes_per_s"]["median"], ls=":", lw=1,
                   color=ax.lines[-1].get_color(), label=f"record writes, {backend}")  # fmt: skip
    ax.axhline(5000, ls="--", color="black", label="goal, PostgreSQL (5,000/s)")
    ax.set_xscale("log")
    ax.set_xlabel("settlement batch size")
    ax.set_ylabel("records/s")
    ax.set_title("4. Settlement, one worker")
    ax.legend(fontsize=7)

    fig.suptitle("spendguard benchmarks: " + results["machine"]["summary"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
