"""The demo gateway under uvicorn with the Redis store, on asyncio's event loop and on uvloop
(``--loop``; uvicorn picks uvloop by default wherever it is installed): on a healthy Redis not
one request is a 503, and a hard limit admits exactly the requests whose worst cases fit, with
all of them arriving at once.

The Redis store's hot path writes to its sockets through the loop's transports; a check that
took them for asyncio's own classes refused uvloop's, and every inference was a 503.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import sqlalchemy as sa

from spendguard.asgi.request import parse_request
from spendguard.engine.costing import Coster
from spendguard.engine.entries import worst_case
from spendguard.engine.pricing import PriceTable
from spendguard.ledger.schema import records
from spendguard.money import micros_to_usd
from spendguard.settings import UnknownModel
from tests.support import (
    UNIT_MODEL,
    RedisServer,
    clean_env,
    free_port,
    run_cli,
    stop,
    uvicorn,
    wait_healthy,
    write_unit_prices,
)
from tests.support.burst import released_together
from tests.support.sql import sql_rows

pytestmark = pytest.mark.both_loops

CONCURRENT = 50
FIT = 7  # the limit is worth this many worst cases, and not one more
# Long enough that every request is checked while the admitted ones still hold their worst
# cases, on a loaded machine too.
UPSTREAM_DELAY = 3.0
BODY = json.dumps(
    {"model": UNIT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
).encode()
HEADERS = {
    "authorization": "Bearer sk-demo-alpha",
    "content-type": "application/json",
    "x-fake-delay": str(UPSTREAM_DELAY),
}


@pytest.fixture
def gateway(
    redis_url: str, tmp_path: Path, loop: str
) -> Iterator[tuple[str, dict[str, str], Path, Path]]:
    prices = write_unit_prices(tmp_path)
    env = clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'ledger.db'}",
        SPENDGUARD_REDIS_URL=redis_url,
        SPENDGUARD_PRICES=str(prices),
        SPENDGUARD_RUN_WORKER="false",
    )
    port, log = free_port(), tmp_path / "gateway.log"
    proc = uvicorn("examples.gateway:app", port, env, log, loop=loop)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield base, env, log, prices
    finally:
        stop([proc], timeout=20)  # graceful: the record buffer is flushed


@pytest.mark.timeout(120)
def test_a_hard_limit_admits_exactly_what_fits_on_each_loop_and_redis_is_never_a_503(
    gateway: tuple[str, dict[str, str], Path, Path], shared_redis: RedisServer
) -> None:
    base, env, log, prices = gateway
    # What the gateway holds per request, computed as it does, from the same table and body.
    hold = worst_case(
        parse_request(BODY), Coster(PriceTable.load(prices), UnknownModel.DEFAULT_PRICE)
    )
    limit = FIT * hold + hold - 1
    run_cli(env, "policy", "set", "--team", "acme", "--api-key", "alpha", "--period", "day",
            "--limit-usd", str(micros_to_usd(limit)), "--mode", "hard")  # fmt: skip

    async def at_once() -> list[int]:
        limits = httpx.Limits(max_connections=CONCURRENT)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            return await released_together(
                CONCURRENT,
                lambda: client.post("/v1/chat/completions", content=BODY, headers=HEADERS),
            )

    statuses = anyio.run(at_once)
    counts = {s: statuses.count(s) for s in set(statuses)}
    assert counts == {200: FIT, 429: CONCURRENT - FIT}, counts
    assert "unavailable" not in log.read_text()

    async def written() -> list[tuple[str, int]]:
        with anyio.fail_after(20):  # the record writer flushes in the background
            while True:
                query = sa.select(records.c.postflight, records.c.estimate_micros)
                rows = [(str(p), int(e)) for p, e in await sql_rows(db_url, query)]
                if len(rows) >= FIT:
                    return rows
                await anyio.sleep(0.1)

    db_url = env["SPENDGUARD_DATABASE_URL"]
    rows = anyio.run(written)
    assert [postflight for postflight, _ in rows] == ["applied"] * FIT
    # Every hold was replaced by its record's estimate, in Redis: the key's counter is their
    # sum, and within the limit.
    (key,) = shared_redis.cli("KEYS", "*:spend:usage:api_key:*:day:*").split()
    flat = shared_redis.cli("HGETALL", key).split()
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    assert not [f for f in fields if f.startswith("h:")], fields
    assert int(fields["p"]) == sum(estimate for _, estimate in rows) <= limit
