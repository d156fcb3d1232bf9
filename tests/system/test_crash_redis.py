"""A Redis-mode gateway killed outright (SIGKILL) under traffic, with streams open: nothing it
admitted is lost, nothing is charged twice, and the cache ends equal to the ledger; so do the
rolling token budgets of the key, the model and the fleet (their holds closed by the same
recovery: the model's and the fleet's are holds stocked ahead, whose commits wait to be
carried by a later finishing round, so the kill leaves some of them unsent).

Each admitted inference leaves an admission entry in Redis in the same script call that admits
it. After the kill, a standalone worker (``spendguard settle``, as an operator would run it)
finds the dead gateway's entries once its heartbeat has lapsed and writes their records: the
whole record for an inference that finished, the admission estimate for a stream cut by the
kill. Settlement then charges each once and brings the cache in step with the ledger.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest
import sqlalchemy as sa

from spendguard.clock import to_micros, utcnow
from spendguard.ledger.schema import charges, records
from spendguard.limits.model import BudgetLimit, SubjectKind
from spendguard.limits.windows import Rolling
from spendguard.store.redis import RedisStore
from spendguard.store.rolling import Bucket, BucketCheck, WindowCheck
from tests.support import TcpProxy, clean_env, free_port, run_cli, uvicorn, wait_healthy
from tests.support.redis import RedisServer
from tests.support.sql import sql_rows, sql_value

pytestmark = pytest.mark.anyio

OWNER_TTL = 2.0
FINISHED = 60  # inferences that end before the kill
OPEN = 4  # streams the upstream stalls: open at the kill
# Token budgets over a rolling hour, far above the traffic: counted, never refusing.
BUDGET_TOKENS = 10**9
MODEL = "gpt-4o-mini"
BUDGETS = {
    "enabled": True,
    "storage": "redis",
    "windows": [{"id": "hourly", "period": "1h"}],
    "scopes": {
        "per_api_key": {"tokens": BUDGET_TOKENS},
        "per_model": {MODEL: {"tokens": BUDGET_TOKENS}},
        "global": {"tokens": BUDGET_TOKENS},
    },
}
_HOURLY = (WindowCheck(Rolling("hourly", "1h", 3600), BudgetLimit(tokens=BUDGET_TOKENS)),)
KEY_BUCKET = BucketCheck(Bucket(SubjectKind.API_KEY, "acme:alpha"), _HOURLY)
SHARED_BUCKETS = (
    BucketCheck(Bucket(SubjectKind.MODEL, MODEL), _HOURLY),
    BucketCheck(Bucket(SubjectKind.FLEET, ""), _HOURLY),
)


async def _gateway_under_traffic(
    env: dict[str, str], tmp_path: Path, loop: str, *, cut: Callable[[], None] | None = None
) -> tuple[set[str], int]:
    """Run the demo gateway, serve FINISHED inferences (half streamed) while OPEN streams
    stall, keep more traffic going and SIGKILL the gateway in the middle of it. ``cut`` runs
    after a first inference has warmed the cache. Returns the inference ids the clients saw
    (every one an admitted inference) and the requests sent. The gateway runs on ``loop``."""
    port, log = free_port(), tmp_path / "gateway.log"
    proc = uvicorn("examples.gateway:app", port, env, log, loop=loop)
    base = f"http://127.0.0.1:{port}"
    seen: set[str] = set()
    sent = 0
    try:
        await anyio.to_thread.run_sync(wait_healthy, base, proc, log)
        headers = {"authorization": "Bearer sk-demo-alpha"}

        def body(i: int, stream: bool) -> dict[str, object]:
            return {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x" * (i + 1)}],
                "stream": stream,
                "max_tokens": 50,
            }

        async with httpx.AsyncClient(base_url=base, timeout=30) as client:

            async def one(i: int) -> None:
                nonlocal sent
                sent += 1
                r = await client.post(
                    "/v1/chat/completions", json=body(i, i % 2 == 0), headers=headers
                )
                await r.aread()
                assert r.status_code == 200, r.text
                seen.add(r.headers["x-spendguard-inference-id"])

            await one(FINISHED)
            if cut is not None:
                cut()
            async with anyio.create_task_group() as tg:
                for i in range(FINISHED - 1):
                    tg.start_soon(one, i)

            streams_open = anyio.Event()
            opened = 0

            async def stalled(i: int) -> None:
                nonlocal sent, opened
                sent += 1
                stall = {**headers, "x-fake-stall-after": "2", "x-fake-chunks": "8"}
                request = client.build_request(
                    "POST", "/v1/chat/completions", json=body(i, True), headers=stall
                )
                r = await client.send(request, stream=True)
                assert r.status_code == 200
                seen.add(r.headers["x-spendguard-inference-id"])
                async for _ in r.aiter_raw():  # the first chunks arrive, then a stall
                    opened += 1
                    if opened == OPEN:
                        streams_open.set()
                    break
                await anyio.sleep_forever()

            async def more(i: int) -> None:
                nonlocal sent
                sent += 1
                try:
                    r = await client.post(
                        "/v1/chat/completions", json=body(i, i % 3 == 0), headers=headers
                    )
                    await r.aread()
                    if r.status_code == 200:
                        seen.add(r.headers["x-spendguard-inference-id"])
                except httpx.TransportError:
                    pass  # killed under it

            async with anyio.create_task_group() as tg:
                for i in range(OPEN):
                    tg.start_soon(stalled, i)
                with anyio.fail_after(20):
                    await streams_open.wait()
                for i in range(40):  # traffic still in flight at the kill
                    tg.start_soon(more, i)
                    await anyio.sleep(0.005)
                proc.send_signal(signal.SIGKILL)  # no shutdown, no flush
                await anyio.sleep(0.5)
                tg.cancel_scope.cancel()

        await anyio.to_thread.run_sync(lambda: proc.wait(timeout=10))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return seen, sent


async def _assert_recovered_exactly(
    env: dict[str, str], db_url: str, server: RedisServer, prefix: str, seen: set[str], sent: int
) -> None:
    await anyio.sleep(OWNER_TTL + 0.5)  # the dead gateway's heartbeat lapses
    await anyio.to_thread.run_sync(run_cli, env, "settle")
    # A second pass finds nothing more: each entry was written once.
    assert (await anyio.to_thread.run_sync(run_cli, env, "settle"))["settled"] == 0
    ids = {str(r[0]) for r in await sql_rows(db_url, sa.select(records.c.id))}
    # Every inference a client saw admitted is in the ledger; the others admitted at the kill
    # (their answer never reached the client) are there too, never more than were sent.
    assert seen <= ids
    assert len(seen) >= FINISHED + OPEN and len(ids) <= sent
    count_charges = await sql_value(db_url, sa.select(sa.func.count()).select_from(charges))
    assert count_charges == len(ids)  # charged exactly once each
    unsettled = await sql_value(
        db_url, sa.select(sa.func.count()).select_from(records).where(~records.c.settled)
    )
    assert unsettled == 0
    assert server.cli("KEYS", f"{prefix}:*:spend:open").strip() == ""  # no entry left
    assert server.cli("SMEMBERS", f"{prefix}:spend:owners").strip() == ""
    # The cache equals the ledger to the micro-USD: the key's usage (settled + pending) is
    # exactly what was charged, with no estimate left pending.
    charged = int(await sql_value(db_url, sa.select(sa.func.sum(charges.c.amount_micros))))
    assert charged > 0
    keys = server.cli("KEYS", f"{prefix}:*:spend:usage:api_key:*:day:*").split()
    assert len(keys) == 1
    settled, pending = server.cli("HMGET", keys[0], "s", "p").split()
    assert int(settled) == charged and int(pending) == 0
    # The key's budget counted every record's tokens once: the cut streams' holds became
    # their recovered charge, and no hold is left to lapse later.
    tokens = await sql_value(
        db_url, sa.select(sa.func.sum(records.c.input_tokens + records.c.output_tokens))
    )
    store = RedisStore.from_url(server.url, prefix=prefix, timeout=2)
    now_ms = to_micros(utcnow()) // 1000
    try:
        bucket = await store.inspect_bucket(KEY_BUCKET, now_ms)
        shared = [await store.inspect_bucket(call, now_ms) for call in SHARED_BUCKETS]
    finally:
        await store.aclose()
    assert (bucket.held_tokens, bucket.windows[0].tokens) == (0, int(tokens))
    # The shared buckets too, each record once; what they still hold is stock the dead
    # gateway drew ahead and no request took, which lapses with the holds' expiry.
    assert [b.windows[0].tokens for b in shared] == [int(tokens)] * 2


def _env(redis: RedisServer, db_url: str, prefix: str) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_REDIS_URL=redis.url,
        SPENDGUARD_DATABASE_URL=db_url,
        SPENDGUARD_KEY_PREFIX=prefix,
        SPENDGUARD_RUN_WORKER="false",  # only the operator's worker settles, after the kill
        SPENDGUARD_OWNER_TTL=str(OWNER_TTL),
        SPENDGUARD_REDIS_TIMEOUT="2",  # a loaded CI machine; this test is about the kill
        SPENDGUARD_BUDGETS=json.dumps(BUDGETS),
    )


@pytest.mark.timeout(180)
@pytest.mark.both_loops
async def test_sigkill_under_traffic_with_open_streams_loses_nothing(
    redis_server: RedisServer, clean_postgres_url: str, tmp_path: Path, loop: str
) -> None:
    prefix = f"crash{uuid.uuid4().hex[:8]}"
    env = _env(redis_server, clean_postgres_url, prefix)
    run_cli(env, "policy", "set", "--team", "acme", "--api-key", "alpha", "--period", "day",
            "--limit-usd", "1000")  # fmt: skip
    seen, sent = await _gateway_under_traffic(env, tmp_path, loop)
    await _assert_recovered_exactly(env, clean_postgres_url, redis_server, prefix, seen, sent)


@pytest.mark.timeout(180)
async def test_sigkill_while_the_database_is_down_loses_nothing(
    redis_server: RedisServer, clean_postgres_url: str, tmp_path: Path, loop: str
) -> None:
    """The database is cut before the traffic ends: the gateway holds its records in memory
    and dies with them; their entries in Redis are all that is left, and enough."""
    server, db = clean_postgres_url.rsplit("/", 1)
    prefix = f"crash{uuid.uuid4().hex[:8]}"
    direct = _env(redis_server, clean_postgres_url, prefix)
    run_cli(direct, "policy", "set", "--team", "acme", "--api-key", "alpha", "--period", "day",
            "--limit-usd", "1000")  # fmt: skip

    async with TcpProxy(int(server.rsplit(":", 1)[1])) as proxy:
        via_proxy = f"{server.rsplit(':', 1)[0]}:{proxy.port}/{db}"
        env = _env(redis_server, via_proxy, prefix)
        seen, sent = await _gateway_under_traffic(env, tmp_path, loop, cut=proxy.down)
    await _assert_recovered_exactly(direct, clean_postgres_url, redis_server, prefix, seen, sent)


@pytest.mark.timeout(120)
async def test_a_gateway_killed_after_a_quiet_moment_counted_every_finish_in_the_shared_budgets(
    redis_server: RedisServer, clean_postgres_url: str, tmp_path: Path
) -> None:
    """The model's and the fleet's commits of a finished request wait for the gateway's next
    admission round. With none coming, they leave with the records writer, before it removes
    the requests' admission entries: once the entries are gone, nothing else could count
    them. So a gateway killed after its records are in the ledger and its entries removed
    (here, after a few quiet seconds) has counted every request in every budget."""
    prefix = f"crash{uuid.uuid4().hex[:8]}"
    env = _env(redis_server, clean_postgres_url, prefix)
    port, log = free_port(), tmp_path / "gateway.log"
    proc = uvicorn("examples.gateway:app", port, env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        await anyio.to_thread.run_sync(wait_healthy, base, proc, log)
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            for i in range(5):
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "x" * i}]},
                    headers={"authorization": "Bearer sk-demo-alpha"},
                )
                assert r.status_code == 200, r.text
        with anyio.fail_after(20):  # the records are written and their entries removed
            while await sql_value(
                clean_postgres_url, sa.select(sa.func.count()).select_from(records)
            ) < 5 or server_keys(redis_server, f"{prefix}:*:spend:open"):
                await anyio.sleep(0.1)
        proc.send_signal(signal.SIGKILL)  # no shutdown, no flush
        await anyio.to_thread.run_sync(lambda: proc.wait(timeout=10))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    tokens = await sql_value(
        clean_postgres_url,
        sa.select(sa.func.sum(records.c.input_tokens + records.c.output_tokens)),
    )
    store = RedisStore.from_url(redis_server.url, prefix=prefix, timeout=2)
    now_ms = to_micros(utcnow()) // 1000
    try:
        counted = [
            (await store.inspect_bucket(call, now_ms)).windows[0].tokens
            for call in (KEY_BUCKET, *SHARED_BUCKETS)
        ]
    finally:
        await store.aclose()
    assert tokens > 0 and counted == [int(tokens)] * 3


def server_keys(server: RedisServer, pattern: str) -> list[str]:
    return server.cli("KEYS", pattern).split()
