"""A real gateway (openai-forward, as docs/integrations/openai-forward.md wraps it) on the
Redis store under ``uvicorn --loop uvloop``: a burst of concurrent inferences from one key gets
no 503, and the key's limit holds. The Redis server is the test's own, on a free port."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import pytest

from spendguard.engine.pricing import PriceTable
from spendguard.testing import expected_usage
from tests.support.redis import RedisServer
from tests.support.services import require_modules, require_redis_server, started_redis

from .forward_gateway import Gateway, forward_config, prepare
from .support import Answer, Identity, Provider, is_spend_refusal, raw_post, serve, wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("openai_forward_installed")]

KEY, WHO = "sk-client-burst", Identity("acme", "burst")
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Name a colour."}]}
COST = int(PriceTable.load().cost("gpt-4o-mini", expected_usage("/v1/chat/completions", CHAT)) or 0)
ALLOWED = 10  # the limit: exactly this many inferences' cost
REQUESTS, CONCURRENCY = 30, 5


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    require_redis_server()
    server = started_redis(RedisServer())  # never the machine's shared server
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(
    provider: Provider, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    require_modules("uvloop")
    into = Path(tmp_path_factory.mktemp("redis-uvloop"))
    limit = str(Decimal(ALLOWED * COST) / 1_000_000)
    launch, env = prepare(
        into,
        "openai-forward.md",
        {KEY: (WHO, limit)},
        FORWARD_CONFIG=forward_config(provider),
        SPENDGUARD_REDIS_URL=redis.url,
    )
    launch.loop = "uvloop"
    server = serve(launch)
    try:
        yield Gateway(server, env, into / "spendguard.db")
    finally:
        server.stop()


def charged(database: Path) -> tuple[int, int]:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as db:
        count, total = db.execute(
            "SELECT count(*), coalesce(sum(amount_micros), 0) FROM spendguard_charges "
            "WHERE api_key = ?",
            (WHO.key_id,),
        ).fetchone()
    return int(count), int(total)


def test_a_burst_on_redis_under_uvloop_gets_no_503_and_the_limit_holds(
    gateway: Gateway, provider: Provider, redis: RedisServer
) -> None:
    maps = Path(f"/proc/{gateway.server.proc.pid}/maps")
    if maps.exists():  # the gateway really runs uvloop's loop (its extension is loaded)
        assert "uvloop" in maps.read_text()

    def one(_: int) -> Answer:
        return raw_post(
            gateway.port, "/v1/chat/completions", CHAT, {"authorization": f"Bearer {KEY}"}
        )

    before = provider.count()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(one, range(REQUESTS)))
    statuses = [a.status for a in answers]
    assert 503 not in statuses, statuses
    served = statuses.count(200)
    assert served + statuses.count(429) == REQUESTS, statuses
    assert all(is_spend_refusal(a) for a in answers if a.status == 429)
    assert provider.count() - before == served
    # Refused once the limit is spent, never before. A soft limit charges when a response has
    # ended, so what may pass beyond it is bounded by what was in flight: per client, the request
    # being admitted and the previous one whose charge had not landed yet.
    assert ALLOWED <= served <= ALLOWED + 2 * CONCURRENCY - 1, statuses
    _, total = wait_for(
        lambda: (found := charged(gateway.database))[0] == served and found, "every charge"
    )
    assert total == served * COST
    before = provider.count()
    assert is_spend_refusal(one(REQUESTS)) and provider.count() == before  # it stays spent
    # The counters were Redis's, not the embedded store's.
    assert redis.cli("--scan", "--pattern", "quota*").split(), "no spendguard key in Redis"
