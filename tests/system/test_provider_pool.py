"""The provider-key pool in the demo gateway, served by uvicorn.

The demo reaches its fake upstream through two keys; ``fake-key-1`` answers every call with a
429 (no Retry-After: the gateway cools it for GATEWAY_COOLDOWN seconds). One gateway routes
around it after its first 429; two gateways on one Redis share that cooldown and each key's
per-minute capacity.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import anyio
import httpx
import pytest

from spendguard.providers import KeyState, ProviderPool
from tests.support import clean_env, free_port, stop, uvicorn, wait_healthy

ALPHA = {"authorization": "Bearer sk-demo-alpha"}
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _gateways(tmp_path: Path, count: int, **env: str) -> Iterator[list[str]]:
    procs, bases = [], []
    try:
        for n in range(count):
            port, log = free_port(), tmp_path / f"gw{n}.log"
            child_env = clean_env(
                SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / f'gw{n}.db'}",
                GATEWAY_COOLDOWN="600",
                **env,
            )
            procs.append(uvicorn("examples.gateway:app", port, child_env, log))
            bases.append(f"http://127.0.0.1:{port}")
            wait_healthy(bases[-1], procs[-1], log)
        yield bases
    finally:
        stop(procs, timeout=20)


def _chat(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=ALPHA, timeout=30)


def _served(response: httpx.Response) -> tuple[int, str | None, str | None]:
    h = response.headers
    return response.status_code, h.get("x-gateway-provider-key"), h.get("x-gateway-attempts")


def _away_from_a_minute_end() -> None:
    """Capacity is per minute: start a capacity check early in a minute, so it runs in one."""
    second = datetime.now(UTC).second
    if second > 40:
        time.sleep(61 - second)


@pytest.fixture
def one_gateway(tmp_path: Path) -> Iterator[str]:
    for bases in _gateways(tmp_path, 1):
        yield bases[0]


@pytest.fixture
def two_gateways(tmp_path: Path, redis_url: str) -> Iterator[list[str]]:
    yield from _gateways(tmp_path, 2, GATEWAY_POOL_URL=redis_url, GATEWAY_PROVIDER_RPM="3")


def _pool_state(redis_url: str, key_id: str) -> KeyState | None:
    async def read() -> KeyState | None:
        pool = ProviderPool.from_url(redis_url, timeout=2)
        try:
            return await pool.state(key_id)
        finally:
            await pool.aclose()

    return anyio.run(read)


@pytest.mark.timeout(180)
def test_demo_routes_around_the_key_that_answers_429(one_gateway: str) -> None:
    first = _chat(one_gateway)
    assert _served(first) == (200, "fake-key-2", "2")  # fake-key-1 tried, 429, cooled down
    assert first.json()["usage"]["completion_tokens"] > 0
    for _ in range(3):  # fake-key-1 is skipped without a call while it cools down
        assert _served(_chat(one_gateway)) == (200, "fake-key-2", "1")


@pytest.mark.timeout(240)
def test_two_gateways_share_cooldowns_and_capacity_through_redis(
    two_gateways: list[str], redis_url: str
) -> None:
    gw0, gw1 = two_gateways
    _away_from_a_minute_end()
    # gw0 meets fake-key-1's 429 and cools it down in Redis; gw1 never calls it.
    served = [_chat(gw0), _chat(gw1)]
    assert [_served(r) for r in served] == [(200, "fake-key-2", "2"), (200, "fake-key-2", "1")]
    # fake-key-2 allows 3 requests a minute across both gateways: one is left.
    served.append(_chat(gw1))
    assert _served(served[-1]) == (200, "fake-key-2", "1")
    # Each lease was settled to the tokens its response reported (not its ~4,100-token
    # estimate); fake-key-1's lease was released after its 429.
    used = sum(r.json()["usage"]["total_tokens"] for r in served)
    deadline = time.monotonic() + 10
    while (state := _pool_state(redis_url, "fake-key-2")) is None or state.tokens != used:
        assert time.monotonic() < deadline, (state, used)
        time.sleep(0.1)
    assert state.requests == 3
    cooling = _pool_state(redis_url, "fake-key-1")
    assert cooling is not None and (cooling.requests, cooling.tokens) == (0, 0)
    assert cooling.cooling_until is not None
    for base in (gw0, gw1):
        refused = _chat(base)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "no_provider_capacity"
        assert 1 <= int(refused.headers["retry-after"]) <= 60  # when fake-key-2's minute ends
