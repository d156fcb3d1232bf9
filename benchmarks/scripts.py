"""Each Lua script's own server time, on the state a real gateway leaves, and an A/B of two
script folders on that same state.

``python -m benchmarks.scripts [--requests N] [--config everything] [--lua DIR] [--json PATH]``

The features benchmark's gateway of one configuration (default ``everything``: every
request-path feature on, see ``benchmarks/features.py``) runs on a private redis-server until
warm; one more request's script calls are recorded as it sends them. Those calls are then
replayed, request after request (a fresh record id each, the clock moved on a millisecond),
every script as a call of its own with ``INFO commandstats`` read around it: the microseconds
the server spent in that script, its inner commands included. Replayed on one connection, one
call at a time, the figures are a script's cost with the server otherwise idle, as at one
request at a time; they are not a throughput (``benchmarks/hotslot.py`` is).

``--lua DIR``: a second folder of scripts (the package's ``spendguard/store/lua`` of another
build, edited), loaded beside the package's own; the two take turns request by request
(ABBA), so the host's drift falls on both alike, and the report gives each script's time under
each and their ratio. The folders must agree on the scripts' keys and arguments. The
package's folder against itself agrees within about 2 % per script here: a change smaller
than that is not shown by this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from contextlib import AsyncExitStack, ExitStack
from hashlib import sha1
from pathlib import Path
from typing import Any

from redis import Redis

from spendguard.store import redis as redis_store

from .common import Services, Sizes, find_guard
from .features import SETS, _middleware, _prepared
from .services import PrivatePostgres, PrivateRedis

Call = tuple[str, list[str], list[str]]  # script name, keys, arguments


def _names() -> dict[str, str]:
    """The package's scripts by their digest."""
    return {
        sha1(redis_store._lua(name).encode()).hexdigest(): name for name in redis_store._SCRIPTS
    }


def _text(folder: Path, name: str) -> str:
    """A script as the store loads it (the budget scripts with their shared helpers first)."""
    text = (folder / f"{name}.lua").read_text("utf-8")
    if name.startswith("bucket_"):
        text = (folder / "bucket_common.lua").read_text("utf-8") + "\n" + text
    return text


async def _recorded(redis_url: str, postgres_url: str, config: str) -> list[Call]:
    """The script calls of one warm request of ``config``'s gateway, in the order sent."""
    names = _names()
    calls: list[Call] = []
    sizes = Sizes.quick()
    async with AsyncExitStack() as stack:
        call, app = await _prepared(stack, redis_url, postgres_url, config, sizes)
        for _ in range(50):
            await call()
        guard = find_guard(app)
        assert guard is not None
        # The shared slot's finishing writes wait to be carried by a later finishing round
        # (engine/carryover.py): the previous requests' are sent before the recording, this
        # one's at its end, so that only its own are recorded, all of them.
        carry = guard.carryover
        if carry is not None:
            await carry.settle()
        pipelines = _pipelines_of(app)
        for pipeline in pipelines:
            pipeline.submit = _recording(pipeline.submit, names, calls)
        try:
            await call()
            await asyncio.sleep(0.2)  # the finishing round, sent after the response
            if carry is not None:
                await carry.settle()
        finally:
            for pipeline in pipelines:
                del pipeline.submit  # the class's own again
    return calls


def _pipelines_of(app: Any) -> list[Any]:
    """Every distinct script pipeline the gateway's parts send through."""
    guard = find_guard(app)
    assert guard is not None
    stores: list[Any] = [guard.store]
    gate = _middleware(app).budgets
    if gate is not None and gate.redis is not None:
        stores.append(gate.redis)
    if guard._pool is not None:
        stores.append(guard._pool.store)
    found = {id(s.pipeline): s.pipeline for s in stores if getattr(s, "pipeline", None)}
    return list(found.values())


def _recording(submit: Any, names: dict[str, str], calls: list[Call]) -> Any:
    def recording(script: Any, keys: Sequence[str], args: Sequence[str]) -> Any:
        calls.append((names.get(script.sha, script.sha), list(keys), [str(a) for a in args]))
        return submit(script, keys, args)

    return recording


def _moved(name: str, args: list[str], record_id: str, new_id: str, ms: int) -> list[str]:
    """A recorded call's arguments for another request: its own record id, ``ms`` later."""
    out = [a.replace(record_id, new_id) for a in args]
    if name == "preflight":
        now = int(out[0]) + 8  # ARGV[n + 9], 1-based: now (see preflight.lua)
        out[now] = str(int(out[now]) + ms)
    elif name == "bucket_reserve":
        out[0], out[2] = str(int(out[0]) + ms), str(int(out[2]) + ms)  # now; expiry
    elif name == "bucket_commit":
        out[0] = str(int(out[0]) + ms)  # now, then each hold's start
        for i in range(int(out[2])):
            out[4 + 4 * i] = str(int(out[4 + 4 * i]) + ms)
    elif name == "pool_acquire":
        out[0] = str(int(out[0]) + ms)
    return out


def replay(
    client: Redis, calls: list[Call], folders: dict[str, Path], requests: int
) -> dict[str, dict[str, list[int]]]:
    """Per folder, per script: the server's µs of every replayed call."""
    preflight = next(args for name, _, args in calls if name == "preflight")
    record_id = preflight[int(preflight[0]) + 1]  # ARGV[n + 2]
    wanted = {name for name, _, _ in calls}
    shas = {
        label: {name: str(client.script_load(_text(folder, name))) for name in wanted}
        for label, folder in folders.items()
    }
    labels = list(folders)
    times: dict[str, dict[str, list[int]]] = {label: {} for label in labels}

    def spent() -> int:
        stat = client.info("commandstats").get("cmdstat_evalsha")
        return int(stat["usec"]) if stat else 0

    for i in range(requests):
        # ABBA: each folder as often first as second.
        label = labels[(i + i // 2) % len(labels)]
        new_id = f"{i:032x}"
        for name, keys, args in calls:
            moved = _moved(name, args, record_id, new_id, i)
            before = spent()
            client.evalsha(shas[label][name], len(keys), *keys, *moved)
            times[label].setdefault(name, []).append(spent() - before)
    return times


def report(calls: list[Call], times: dict[str, dict[str, list[int]]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for name, _, _ in calls:
        counts[name] = counts.get(name, 0) + 1
    out: dict[str, Any] = {"scripts": {}, "per_request": {}}
    for label, by_name in times.items():
        total = 0.0
        for name, values in by_name.items():
            mean = statistics.fmean(values)
            out["scripts"].setdefault(name, {"calls_per_request": counts[name]})[label] = mean
            total += mean * counts[name]
        out["per_request"][label] = total
    return out


def _table(result: dict[str, Any], labels: list[str]) -> list[str]:
    head = ["script", "calls / request", *(f"µs, {label}" for label in labels)]
    if len(labels) == 2:
        head.append("B / A")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [*result["scripts"].items(), ("per request", {**result["per_request"]})]
    for name, row in rows:
        cells = [name, str(row.get("calls_per_request", ""))]
        cells += [f"{row[label]:.1f}" for label in labels]
        if len(labels) == 2:
            cells.append(f"{row[labels[1]] / row[labels[0]]:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scripts")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--config", choices=sorted(SETS), default="everything")
    parser.add_argument("--lua", type=Path, help="a second script folder to A/B against")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "SPENDGUARD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    args = parser.parse_args()
    own = Path(redis_store.__file__).parent / "lua"
    folders = {"A": own} if args.lua is None else {"A": own, "B": args.lua}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sg-scripts-")))
        server = stack.enter_context(PrivateRedis())
        pg = stack.enter_context(PrivatePostgres(args.postgres_url))
        services = Services(server.url, pg.url, workdir)
        calls = asyncio.run(_recorded(services.redis_url, services.postgres_url, args.config))
        client = Redis.from_url(server.url)
        try:
            times = replay(client, calls, folders, args.requests)
        finally:
            client.close()
    result = report(calls, times)
    result["config"] = args.config
    result["folders"] = {label: str(path) for label, path in folders.items()}
    print(f"Scripts of one '{args.config}' request, {args.requests} requests replayed")
    print("\n".join(_table(result, list(folders))))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
