"""Rates per key and per team, end to end through the official openai SDK: RPM and TPM 429s
``rate_limit_exceeded`` with OpenAI's ``x-ratelimit-*`` headers (the key's own rates), the
parallel cap with streams held open, and the CLI's ``rate set|rm|ls``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from spendguard.limits import Period
from spendguard.store import Store
from spendguard.store.memory import MemoryStore
from spendguard.store.redis import RedisStore
from spendguard.testing.transport import StreamingASGITransport
from tests.support import Clock, Gateway, call_cli, run_cli
from tests.support.gateway import MODEL
from tests.support.processes import clean_env
from tests.testing.wire import openai_client

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    redis = RedisStore.from_url(request.getfixturevalue("redis_url"), timeout=2.0)
    try:
        yield redis
    finally:
        await redis.aclose()


@asynccontextmanager
async def gateway(tmp_path: Path, store: Store) -> AsyncIterator[Gateway]:
    # The start of a minute (near real time: Redis expires the usage keys by its own clock),
    # so every window edge below is exact.
    clock = Clock(datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1))
    if isinstance(store, MemoryStore):
        store = MemoryStore(clock=clock)
    async with Gateway(tmp_path, clock, store=store) as gw:
        await gw.policy(Period.DAY, 10**9)
        yield gw


async def test_rpm_429_carries_openai_headers_and_charges_nothing(
    tmp_path: Path, store: Store
) -> None:
    async with gateway(tmp_path, store) as gw:
        await gw.guard.admin.set_rates("acme", "alpha", rpm=2)
        await gw.guard.admin.set_rates("acme", None, rpm=100)  # the team's: never shown
        async with openai_client(gw.app) as client:
            raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=HI)
            assert raw.headers["x-ratelimit-limit-requests"] == "2"
            assert raw.headers["x-ratelimit-remaining-requests"] == "1"
            assert raw.headers["x-ratelimit-reset-requests"] == "2m0s"
            assert "x-ratelimit-limit-tokens" not in raw.headers  # no TPM rate
            await client.chat.completions.create(model=MODEL, messages=HI)
            gw.clock.now += timedelta(seconds=30)
            with pytest.raises(openai.RateLimitError) as denied:
                await client.chat.completions.create(model=MODEL, messages=HI)
        error = denied.value
        assert error.code == "rate_limit_exceeded" and error.type == "requests"
        assert "API Key" in error.message and "requests per minute" in error.message
        headers = error.response.headers
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"] == "1m30s"
        # This minute ends in 30 s; then its 2 weigh 2 * (1 - e/60) + 1 <= 2 from e = 30 s.
        assert headers["retry-after"] == "60"
        assert "x-should-retry" not in headers  # a rate is worth retrying, unlike a limit
        await gw.settle()
        assert await gw.guard.ledger.charges_total() == 30  # two requests of 15
        # The team's rate denies every key once it is reached; a key's rate is its own.
        await gw.guard.admin.set_rates("acme", "alpha", rpm=0)
        await gw.guard.admin.set_rates("acme", None, rpm=3)
        async with openai_client(gw.app) as client:
            await client.chat.completions.create(model=MODEL, messages=HI)
            with pytest.raises(openai.RateLimitError) as team:
                await client.chat.completions.create(model=MODEL, messages=HI)
        assert "Team" in team.value.message
        assert "x-ratelimit-limit-requests" not in team.value.response.headers


async def test_tpm_reserves_then_trues_up_and_429s_with_token_headers(
    tmp_path: Path, store: Store
) -> None:
    async with gateway(tmp_path, store) as gw:
        await gw.guard.admin.set_rates("acme", "alpha", tpm=5000)
        async with openai_client(gw.app) as client:
            # Reserved: the body's size in tokens + 4,000; used: 10 in + 4,000 out.
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=HI, max_tokens=4000, extra_body={"x_out": 4000}
            )
            assert raw.headers["x-ratelimit-limit-tokens"] == "5000"
            assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 1000  # the reservation
            # 4,010 used, so 990 are left: a reservation of 1,000 + the body does not fit.
            with pytest.raises(openai.RateLimitError) as denied:
                await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1000)
            # One that fits in what the true-up left is admitted.
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=900)
            # A request larger than the rate itself is refused for good.
            with pytest.raises(openai.RateLimitError) as too_large:
                await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6000)
        error = denied.value
        assert error.code == "rate_limit_exceeded" and error.type == "tokens"
        headers = error.response.headers
        assert headers["x-ratelimit-limit-tokens"] == "5000"
        assert headers["x-ratelimit-remaining-tokens"] == "990"
        assert headers["x-ratelimit-reset-tokens"] == "2m0s"
        # The minute must end, then its 4,010 fade until the reservation fits (about 0.5 s).
        assert 60 < int(headers["retry-after"]) <= 61
        assert "Request too large" in too_large.value.message
        assert too_large.value.response.headers["x-should-retry"] == "false"


async def test_upstream_errors_release_their_token_reservation(
    tmp_path: Path, store: Store
) -> None:
    async with gateway(tmp_path, store) as gw:
        await gw.guard.admin.set_rates("acme", "alpha", tpm=5000)
        async with openai_client(gw.app) as client:
            for _ in range(3):  # each reserves over 4,000: only a release lets the next in
                with pytest.raises(openai.InternalServerError):
                    await client.chat.completions.create(
                        model=MODEL, messages=HI, max_tokens=4000, extra_body={"x_status": 500}
                    )


async def test_parallel_cap_with_streams_held_open(tmp_path: Path, store: Store) -> None:
    async with gateway(tmp_path, store) as gw:
        await gw.guard.admin.set_rates("acme", "alpha", max_parallel=2)
        http = httpx.AsyncClient(transport=StreamingASGITransport(gw.app))
        async with openai.AsyncOpenAI(
            base_url="http://fake/v1", api_key="x", max_retries=0, http_client=http
        ) as client:
            streams = []
            for _ in range(2):  # each sends one chunk, then hangs
                stream = await client.chat.completions.create(
                    model=MODEL, messages=HI, stream=True, extra_body={"x_stall_at": 1}
                )
                await stream.__anext__()
                streams.append(stream)
            with pytest.raises(openai.RateLimitError) as denied:
                await client.chat.completions.create(model=MODEL, messages=HI)
            assert denied.value.code == "rate_limit_exceeded"
            assert "parallel requests" in denied.value.message
            assert denied.value.response.headers["retry-after"] == "1"
            # One client leaves: its inference ends (charged as served) and frees its slot.
            await streams[0].close()
            with anyio.fail_after(10):
                while gw.postflights < 1:
                    await anyio.sleep(0.01)
            done = await client.chat.completions.create(model=MODEL, messages=HI)
            assert done.usage is not None
            await streams[1].close()


def test_cli_rate_set_rm_ls(tmp_path: Path) -> None:
    env = clean_env(SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'l.db'}")
    out = run_cli(env, "rate", "set", "--team", "acme", "--api-key", "k", "--rpm", "60")
    assert out == {
        "team": "acme",
        "rates": [{"api_key": "k", "rpm": 60, "tpm": None, "max_parallel": None}],
    }
    # One real process above; the same command's other calls in process (call_cli).
    call_cli(env, "rate", "set", "--team", "acme", "--max-parallel", "4", "--rpm", "600")
    # A rate not given is kept; 0 removes one.
    out = call_cli(
        env, "rate", "set", "--team", "acme", "--api-key", "k", "--rpm", "0", "--tpm", "9"
    )
    assert out["rates"] == [  # the team's own first, as the admin HTTP routes answer
        {"api_key": None, "rpm": 600, "tpm": None, "max_parallel": 4},
        {"api_key": "k", "rpm": None, "tpm": 9, "max_parallel": None},
    ]
    call_cli(env, "rate", "rm", "--team", "acme")
    assert call_cli(env, "rate", "ls", "--team", "acme")["rates"] == [
        {"api_key": "k", "rpm": None, "tpm": 9, "max_parallel": None}
    ]


async def test_anthropic_routes_get_their_rate_limit_error(tmp_path: Path, store: Store) -> None:
    async with gateway(tmp_path, store) as gw:
        await gw.guard.admin.set_rates("acme", "alpha", rpm=1)
        body = {"model": MODEL, "max_tokens": 10, "messages": HI}
        async with gw.client() as client:
            assert (await client.post("/v1/messages", json=body)).status_code == 200
            denied = await client.post("/v1/messages", json=body)
        assert denied.status_code == 429
        assert denied.json()["error"]["type"] == "rate_limit_error"
        assert denied.headers["x-ratelimit-remaining-requests"] == "0"
        # At 1 RPM the one request must fade out entirely: the rest of this minute and the next.
        assert denied.headers["retry-after"] == "120"
