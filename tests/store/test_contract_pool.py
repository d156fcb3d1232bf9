"""The store contract's provider-capacity part, through the pool's API, on every store (the
harness in conftest.py).

The pool's clock is injected and every store call carries the time, so the same frozen clock
drives windows and cooldowns on all three: no test sleeps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import anyio
import pytest

from spendguard.providers import NoCapacity, ProviderKey, ProviderPool, Refusal
from spendguard.store import Store
from tests.store.conftest import Harness
from tests.support import Clock

pytestmark = pytest.mark.anyio

# Ten seconds into a minute: a window ends 50 s later.
START = datetime(2026, 9, 30, 12, 0, 10, tzinfo=UTC)
NEXT_MINUTE = datetime(2026, 9, 30, 12, 1, tzinfo=UTC)


@dataclass
class PoolHarness:
    pool: ProviderPool
    store: Store
    clock: Clock

    def advance(self, seconds: float) -> None:
        self.clock.now += timedelta(seconds=seconds)


@pytest.fixture
def h(harness: Harness) -> PoolHarness:
    """The pool on the store under test, its clock frozen (every call carries the time)."""
    clock = Clock(START)
    return PoolHarness(ProviderPool(harness.store, clock=clock, owned=False), harness.store, clock)


async def test_acquire_reserves_a_request_and_tokens(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=1000, rpm=10))
    lease = await h.pool.acquire(["a"], tokens=300)
    assert (lease.key_id, lease.tokens) == ("a", 300)
    state = await h.pool.state("a")
    assert state is not None
    assert (state.provider, state.tpm, state.rpm) == ("openai", 1000, 10)
    assert (state.requests, state.tokens, state.cooling_until) == (1, 300, None)
    assert state.window_ends == NEXT_MINUTE


async def test_rpm_is_a_hard_cap_per_window(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", rpm=2))
    await h.pool.acquire(["a"], tokens=1)
    await h.pool.acquire(["a"], tokens=1)
    with pytest.raises(NoCapacity) as full:
        await h.pool.acquire(["a"], tokens=1)
    assert full.value.refusals == {"a": Refusal.FULL}
    assert full.value.retry_at == NEXT_MINUTE
    assert full.value.retry_after == 50
    h.clock.now = NEXT_MINUTE  # a new window: the counters start again
    await h.pool.acquire(["a"], tokens=1)
    state = await h.pool.state("a")
    assert state is not None and state.requests == 1


async def test_tpm_takes_what_fits_and_refuses_the_rest(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100))
    await h.pool.acquire(["a"], tokens=60)
    with pytest.raises(NoCapacity):
        await h.pool.acquire(["a"], tokens=41)
    await h.pool.acquire(["a"], tokens=40)  # exactly full
    with pytest.raises(NoCapacity):
        await h.pool.acquire(["a"], tokens=1)
    state = await h.pool.state("a")
    assert state is not None and (state.requests, state.tokens) == (2, 100)


async def test_an_estimate_over_the_whole_tpm_never_fits(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100))
    with pytest.raises(NoCapacity) as refused:
        await h.pool.acquire(["a"], tokens=101)
    assert refused.value.refusals == {"a": Refusal.TOO_LARGE}
    assert refused.value.retry_at is None and refused.value.retry_after is None


async def test_candidates_are_tried_in_order(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", rpm=1), ProviderKey("b", "openai", rpm=1))
    assert (await h.pool.acquire(["a", "b"], tokens=1)).key_id == "a"
    assert (await h.pool.acquire(["a", "b"], tokens=1)).key_id == "b"  # a is full
    with pytest.raises(NoCapacity) as full:
        await h.pool.acquire(["a", "b", "nobody"], tokens=1)
    assert full.value.refusals == {"a": Refusal.FULL, "b": Refusal.FULL, "nobody": Refusal.UNKNOWN}
    assert full.value.retry_at == NEXT_MINUTE


async def test_unknown_keys_are_refused(h: PoolHarness) -> None:
    with pytest.raises(NoCapacity) as refused:
        await h.pool.acquire(["ghost"], tokens=1)
    assert refused.value.refusals == {"ghost": Refusal.UNKNOWN}
    assert refused.value.retry_at is None
    assert await h.pool.state("ghost") is None
    assert await h.pool.cooldown("ghost", 5) is None


async def test_settle_trues_up_the_reservation_in_its_window(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100))
    lease = await h.pool.acquire(["a"], tokens=80)
    await h.pool.settle(lease, tokens=20)  # the call used less than its estimate
    await h.pool.acquire(["a"], tokens=80)  # fits only because 60 came back
    state = await h.pool.state("a")
    assert state is not None and (state.requests, state.tokens) == (2, 100)
    lease = await h.pool.acquire(["a"], tokens=0)
    await h.pool.settle(lease, tokens=30)  # more than estimated: over capacity, as it was
    state = await h.pool.state("a")
    assert state is not None and state.tokens == 130


async def test_settle_in_a_later_window_charges_only_the_excess(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100))
    short = await h.pool.acquire(["a"], tokens=50)
    long = await h.pool.acquire(["a"], tokens=10)
    h.clock.now = NEXT_MINUTE + timedelta(seconds=5)
    await h.pool.settle(short, tokens=20)  # under its estimate: nothing to give back now
    await h.pool.settle(long, tokens=40)  # 30 beyond its estimate land in this window
    state = await h.pool.state("a")
    assert state is not None and (state.requests, state.tokens) == (0, 30)
    with pytest.raises(NoCapacity):
        await h.pool.acquire(["a"], tokens=71)
    await h.pool.acquire(["a"], tokens=70)


async def test_release_gives_back_the_request_and_tokens(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100, rpm=1))
    lease = await h.pool.acquire(["a"], tokens=100)
    await h.pool.release(lease)
    state = await h.pool.state("a")
    assert state is not None and (state.requests, state.tokens) == (0, 0)
    await h.pool.acquire(["a"], tokens=100)


async def test_release_in_a_later_window_leaves_that_window_alone(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100, rpm=5))
    old = await h.pool.acquire(["a"], tokens=60)
    h.clock.now = NEXT_MINUTE
    await h.pool.acquire(["a"], tokens=50)
    await h.pool.release(old)
    state = await h.pool.state("a")
    assert state is not None and (state.requests, state.tokens) == (1, 50)


async def test_cooldown_is_skipped_until_it_ends(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai"), ProviderKey("b", "openai"))
    ends = await h.pool.cooldown("a", 30)
    assert ends == START + timedelta(seconds=30)
    assert (await h.pool.acquire(["a", "b"], tokens=1)).key_id == "b"
    state = await h.pool.state("a")
    assert state is not None and state.cooling_until == ends and state.requests == 0
    await h.pool.cooldown("b", 10)
    with pytest.raises(NoCapacity) as cooling:
        await h.pool.acquire(["a", "b"], tokens=1)
    assert cooling.value.refusals == {"a": Refusal.COOLING, "b": Refusal.COOLING}
    assert cooling.value.retry_at == START + timedelta(seconds=10)  # the earliest to free
    h.advance(30)
    assert (await h.pool.acquire(["a", "b"], tokens=1)).key_id == "a"
    state = await h.pool.state("a")
    assert state is not None and state.cooling_until is None


async def test_a_cooldown_is_never_shortened(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai"))
    await h.pool.cooldown("a", 60)
    assert await h.pool.cooldown("a", 5) == START + timedelta(seconds=60)
    h.advance(59)
    with pytest.raises(NoCapacity):
        await h.pool.acquire(["a"], tokens=1)
    h.advance(1)
    await h.pool.acquire(["a"], tokens=1)


async def test_a_cooldown_is_bounded(h: PoolHarness) -> None:
    pool = ProviderPool(h.store, clock=h.clock, max_cooldown=120, owned=False)
    await pool.register(ProviderKey("a", "openai"))
    assert await pool.cooldown("a", 86_400) == START + timedelta(seconds=120)


async def test_registering_again_keeps_counters_and_cooldown(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", tpm=100, rpm=10))
    await h.pool.acquire(["a"], tokens=70)
    await h.pool.cooldown("a", 5)
    await h.pool.register(ProviderKey("a", "azure", tpm=200))  # rpm now unlimited
    state = await h.pool.state("a")
    assert state is not None
    assert (state.provider, state.tpm, state.rpm, state.requests, state.tokens) == (
        "azure",
        200,
        None,
        1,
        70,
    )
    assert state.cooling_until == START + timedelta(seconds=5)
    h.advance(5)
    await h.pool.acquire(["a"], tokens=130)  # the new capacity, counted on the old usage


async def test_removed_keys_are_unknown(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai"))
    await h.pool.remove("a")
    with pytest.raises(NoCapacity) as refused:
        await h.pool.acquire(["a"], tokens=1)
    assert refused.value.refusals == {"a": Refusal.UNKNOWN}


async def test_ids_are_kept_apart_whatever_they_contain(h: PoolHarness) -> None:
    ids = ["a:b", "a}b{", "a%3Ab", "x" * 500, "ключ 🔑"]
    await h.pool.register(*(ProviderKey(i, "openai", rpm=1) for i in ids))
    for i in ids:
        assert (await h.pool.acquire([i], tokens=1)).key_id == i
    for i in ids:
        state = await h.pool.state(i)
        assert state is not None and state.requests == 1


async def test_100_concurrent_callers_at_a_capacity_of_5(h: PoolHarness) -> None:
    await h.pool.register(ProviderKey("a", "openai", rpm=5), ProviderKey("b", "openai", tpm=50))
    granted: list[str] = []

    async def one() -> None:
        with contextlib.suppress(NoCapacity):
            granted.append((await h.pool.acquire(["a", "b"], tokens=10)).key_id)

    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(one)
    assert sorted(granted) == ["a"] * 5 + ["b"] * 5


async def test_settlements_sent_together_count_as_sent_one_by_one(h: PoolHarness) -> None:
    """``settle_later`` and ``settle_together``: the settlements a gateway carried, one call
    per key. Leases of the lapsed window and of the current one, under and over their
    estimates, end where settling each in turn leaves them; a lease already settled is not
    settled again."""
    await h.pool.register(
        ProviderKey("a", "openai", tpm=1000), ProviderKey("b", "openai", tpm=1000)
    )
    old = {k: [await h.pool.acquire([k], tokens=n) for n in (50, 10)] for k in "ab"}
    h.clock.now = NEXT_MINUTE + timedelta(seconds=5)
    new = {k: [await h.pool.acquire([k], tokens=n) for n in (80, 5)] for k in "ab"}
    used = (20, 40, 30, 25)  # under, over (lapsed window); under, over (this one)
    together = [
        h.pool.settle_later(lease, n) for lease, n in zip([*old["a"], *new["a"]], used, strict=True)
    ]
    assert all(s is not None for s in together)
    assert h.pool.settle_later(old["a"][0], 99) is None  # settled already: nothing to send
    await h.pool.settle_together("a", [s for s in together if s is not None])
    for lease, n in zip([*old["b"], *new["b"]], used, strict=True):
        await h.pool.settle(lease, tokens=n)
    a, b = await h.pool.state("a"), await h.pool.state("b")
    assert a is not None and b is not None
    # This window: 30 beyond the lapsed lease's estimate, then 30 and 25 used of 85 reserved.
    assert (a.requests, a.tokens) == (b.requests, b.tokens) == (2, 30 + 30 + 25)
