"""Hard limits hold under concurrency: each admitted request holds its worst case until it
ends, in the same atomic step as the check, on the embedded store, Redis and a Redis Cluster.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from spendguard import SpendGuardMiddleware
from spendguard.asgi.request import parse_request
from spendguard.clock import utcnow
from spendguard.engine.entries import worst_case
from spendguard.identity import Identity
from spendguard.limits import Balance, Period, Target, key_limit
from spendguard.money import micros_to_usd
from spendguard.store import Store
from spendguard.store.memory import MemoryStore
from spendguard.store.redis import RedisStore
from spendguard.usage import Dialect
from tests.support import Gateway, chat_body, run_cli
from tests.support.asgi import StateAuth
from tests.support.prices import UNIT_MODEL
from tests.support.processes import clean_env

pytestmark = pytest.mark.anyio

CONCURRENT = 200
FIT = 10  # the limit is worth this many worst cases
BODY = {"model": UNIT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
ACTUAL_IN, ACTUAL_OUT = 7, 3  # what the provider reports: far below the worst case


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        url = cluster.url
    s = RedisStore.from_url(url, timeout=2.0)
    try:
        yield s
    finally:
        await s.aclose()


class HeldUpstream:
    """A provider that answers only once released: every admitted request is in flight."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.arrived = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        self.arrived += 1
        await self.release.wait()
        usage = {"prompt_tokens": ACTUAL_IN, "completion_tokens": ACTUAL_OUT}
        body = json.dumps({"model": UNIT_MODEL, "choices": [], "usage": usage}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.mark.timeout(120)
@pytest.mark.both_loops
@pytest.mark.parametrize("cap", ["limit", "balance"])
async def test_200_concurrent_requests_admit_only_what_fits_a_hard_limit(
    tmp_path: Path, store: Store, cap: str
) -> None:
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        hold = worst_case(parse_request(json.dumps(BODY).encode()), gw.guard.coster)
        limit = FIT * hold
        if cap == "limit":
            await gw.guard.admin.set_policy(
                "acme", "alpha", window=Period.DAY, limit_usd=micros_to_usd(limit), hard=True
            )
            target: Target = key_limit(Identity("acme", "alpha"), Period.DAY)
        else:  # a prepaid account worth FIT worst cases
            await gw.guard.admin.topup("acme", micros_to_usd(limit))
            await gw.guard.admin.set_balance_mode("acme", hard=True)
            target = Balance(Identity("acme").team)
        upstream = HeldUpstream()
        app = StateAuth(SpendGuardMiddleware(upstream, guard=gw.guard))
        statuses: list[int] = []
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:

            async def one() -> None:
                r = await client.post("/v1/chat/completions", json=BODY)
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(CONCURRENT):
                    tg.start_soon(one)
                with anyio.fail_after(30):  # every request either held upstream or refused
                    while upstream.arrived + len(statuses) < CONCURRENT:
                        await anyio.sleep(0.01)
                assert upstream.arrived == FIT  # exactly the worst cases that fit
                upstream.release.set()
        assert statuses.count(200) == FIT and statuses.count(429) == CONCURRENT - FIT
        key = gw.guard.codec.check(target, utcnow())
        # The holds were replaced by the actual estimates: nothing else is held.
        per_request = ACTUAL_IN + ACTUAL_OUT
        assert (await store.read_usage([key.usage_key]))[key.usage_key] == FIT * per_request
        await gw.settle()
        charged = await gw.guard.ledger.charges_total()
        assert charged == FIT * per_request <= limit
        assert (await store.read_usage([key.usage_key]))[key.usage_key] == charged
        # Capacity came back with the released holds: a next request fits again.
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            with anyio.fail_after(10):
                assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200


async def test_a_hard_limit_releases_the_hold_of_an_upstream_error(
    tmp_path: Path, store: Store
) -> None:
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        body = json.dumps(chat_body(x_status=502, max_tokens=100)).encode()
        hold = worst_case(parse_request(body), gw.guard.coster)
        # Room for one hold, never two (a few bytes of JSON spacing either way).
        limit = 2 * hold - 10
        await gw.guard.admin.set_policy(
            "acme", "alpha", window=Period.DAY, limit_usd=micros_to_usd(limit), hard=True
        )
        key = gw.guard.codec.check(key_limit(Identity("acme", "alpha"), Period.DAY), utcnow())
        for _ in range(3):  # each error gives the hold back: the next one fits again
            r = await gw.post(x_status=502, max_tokens=100)
            assert r.status_code == 502
            assert (await store.read_usage([key.usage_key]))[key.usage_key] == 0
        assert await gw.guard.ledger.unsettled() == (0, 0)  # nothing charged


async def test_usage_json_shows_holds_next_to_settled_and_pending(
    tmp_path: Path, redis_url: str
) -> None:
    store = RedisStore.from_url(redis_url, timeout=2.0)
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        await gw.guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1, hard=True)
        request = parse_request(json.dumps(BODY).encode())
        running = await gw.guard.admit(
            Identity("acme", "alpha"), request, route="/v1/chat/completions", dialect=Dialect.OPENAI
        )
        assert running.allowed
        env = clean_env(
            SPENDGUARD_DATABASE_URL=gw.settings.database_url.get_secret_value(),
            SPENDGUARD_REDIS_URL=redis_url,
        )
        report = await anyio.to_thread.run_sync(
            lambda: run_cli(env, "usage", "--team", "acme", "--api-key", "alpha")
        )
        day = next(r for r in report["limits"] if (r["scope"], r["period"]) == ("api_key", "day"))
        hold = worst_case(request, gw.guard.coster)
        assert day["cache"] == {"settled_micros": 0, "pending_micros": 0, "held_micros": hold}, (
            report
        )
        await gw.guard.finish(running, 502, None)
    await store.aclose()
