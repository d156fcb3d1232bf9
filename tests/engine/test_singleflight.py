"""Tests for spendguard.engine.singleflight: concurrent identical loads share one call."""

from __future__ import annotations

import anyio
import pytest

from spendguard.engine.singleflight import SingleFlight

pytestmark = pytest.mark.anyio


async def test_single_flight_coalesces_concurrent_loads() -> None:
    flight: SingleFlight[int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.05)
        return 42

    results: list[int] = []

    async def one() -> None:
        results.append(await flight.do("team", load))

    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(one)
    assert calls == 1 and results == [42] * 100
    assert await flight.do("team", load) == 42 and calls == 2  # not cached after it finished


async def test_single_flight_shares_failures() -> None:
    flight: SingleFlight[int] = SingleFlight()

    async def boom() -> int:
        await anyio.sleep(0.01)
        raise RuntimeError("db down")

    errors: list[str] = []

    async def one() -> None:
        try:
            await flight.do("k", boom)
        except RuntimeError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert errors == ["db down"] * 5


async def test_single_flight_survives_a_cancelled_leader() -> None:
    flight: SingleFlight[int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.1)
        return 7

    results: list[int] = []

    async def follower() -> None:
        await anyio.sleep(0.01)
        results.append(await flight.do("k", load))

    async with anyio.create_task_group() as tg:
        tg.start_soon(follower)
        with anyio.move_on_after(0.03):  # the leader's request goes away mid-load
            await flight.do("k", load)
    assert results == [7] and calls == 2
