"""One contract for every store. The Redis store (next milestone) joins the parametrization."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from spendguard.errors import StoreFull
from spendguard.identity import Identity
from spendguard.keys import KeyPlan, plan
from spendguard.store.base import Outcome, Store, UsageFill
from spendguard.store.memory import MemoryStore

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 9, 30, 12, 0, tzinfo=UTC)
GRACE = timedelta(days=2)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


StoreFactory = Callable[..., Store]


@pytest.fixture(params=["memory"])
def make_store(request: pytest.FixtureRequest) -> StoreFactory:
    def factory(clock: Clock, max_keys: int = 1000) -> Store:
        return MemoryStore(max_keys=max_keys, clock=clock)

    return factory


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def store(make_store: StoreFactory, clock: Clock) -> Store:
    return make_store(clock)


def keys_for(team: str = "acme", key: str | None = "alpha", t0: datetime = T0) -> KeyPlan:
    return plan("quota", Identity(team, key), t0, GRACE)


def field_of(p: KeyPlan, name: str) -> UsageFill:
    cand = next(c for c in p.candidates if c.field == name)
    return UsageFill(cand.usage_key, 0, cand.expires_at)


async def warm(store: Store, p: KeyPlan, limits: dict[str, int], settled: int = 0) -> None:
    fills = [
        UsageFill(c.usage_key, settled, c.expires_at) for c in p.candidates if c.field in limits
    ]
    await store.fill(p, limits, fills, policy_ttl=60)


async def test_empty_store_reports_a_policy_miss(store: Store) -> None:
    pf = await store.preflight(keys_for())
    assert pf.outcome is Outcome.MISS and pf.missing_policy


async def test_no_policy_is_cached_and_reads_no_usage(store: Store) -> None:
    p = keys_for()
    await store.fill(p, {}, [], policy_ttl=60)
    pf = await store.preflight(p)
    assert pf.outcome is Outcome.ALLOW and pf.limits == ()
    if isinstance(store, MemoryStore):
        assert store.usage_reads == 0


async def test_policy_without_usage_key_reports_which_keys_miss(store: Store) -> None:
    p = keys_for()
    await store.fill(p, {"team:month": 100}, [], policy_ttl=60)
    pf = await store.preflight(p)
    assert pf.outcome is Outcome.MISS and not pf.missing_policy
    assert [c.field for c in pf.missing_usage] == ["team:month"]


@pytest.mark.parametrize(
    ("used", "limit", "outcome"), [(99, 100, "allow"), (100, 100, "deny"), (0, 0, "deny")]
)
async def test_usage_at_limit_denies_and_one_below_allows(
    store: Store, used: int, limit: int, outcome: str
) -> None:
    p = keys_for()
    await warm(store, p, {"api_key:alpha:day": limit}, settled=used)
    pf = await store.preflight(p)
    assert pf.outcome == outcome
    assert pf.limits[-1].used == used and pf.limits[-1].limit == limit


async def test_every_configured_limit_must_pass(store: Store) -> None:
    p = keys_for()
    await store.fill(
        p,
        {"api_key:alpha:day": 5_000_000, "team:month": 200_000_000},
        [
            UsageFill(field_of(p, "api_key:alpha:day").usage_key, 1, T0 + GRACE),
            UsageFill(field_of(p, "team:month").usage_key, 200_000_000, T0 + GRACE),
        ],
        policy_ttl=60,
    )
    pf = await store.preflight(p)
    assert pf.outcome is Outcome.DENY
    assert pf.denied is not None and pf.denied.candidate.field == "team:month"


async def test_postflight_adds_once_and_never_creates_keys(store: Store) -> None:
    p = keys_for()
    await warm(store, p, {"api_key:alpha:day": 1000})
    day = field_of(p, "api_key:alpha:day").usage_key
    month = field_of(p, "team:month").usage_key  # no policy, never filled
    assert await store.postflight("r1", 40, [day, month]) == 1
    assert await store.postflight("r1", 40, [day]) == 0  # a re-sent record adds nothing
    assert await store.read_usage([day, month]) == {day: 40, month: None}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
async def test_postflight_validates_before_writing(store: Store, bad: object) -> None:
    p = keys_for()
    await warm(store, p, {"api_key:alpha:day": 1000})
    day = field_of(p, "api_key:alpha:day").usage_key
    with pytest.raises(ValueError):
        await store.postflight("r1", bad, [day])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.postflight("", 5, [day])
    assert await store.read_usage([day]) == {day: 0}


async def test_fill_never_overwrites_what_postflight_added(store: Store) -> None:
    p = keys_for()
    await warm(store, p, {"api_key:alpha:day": 1000}, settled=10)
    day = field_of(p, "api_key:alpha:day").usage_key
    await store.postflight("r1", 5, [day])
    await warm(store, p, {"api_key:alpha:day": 1}, settled=0)  # a stale second loader
    assert await store.read_usage([day]) == {day: 15}
    assert (await store.preflight(p)).limits[0].limit == 1000


async def test_refresh_replaces_settled_and_drops_each_estimate_once(store: Store) -> None:
    p = keys_for()
    await warm(store, p, {"api_key:alpha:day": 10_000}, settled=100)
    day = field_of(p, "api_key:alpha:day").usage_key
    await store.postflight("r1", 30, [day])
    await store.postflight("r2", 50, [day])
    # r1 settled at an exact charge of 32: settled 100 -> 132, pending keeps only r2.
    await store.refresh({day: 132}, ["r1"])
    assert await store.read_usage([day]) == {day: 182}
    await store.refresh({day: 132}, ["r1"])  # idempotent
    assert await store.read_usage([day]) == {day: 182}
    await store.refresh({day: 132}, ["never-applied"])  # unknown record: nothing subtracted
    assert await store.read_usage([day]) == {day: 182}


async def test_refresh_does_not_create_absent_keys(store: Store) -> None:
    p = keys_for()
    day = field_of(p, "api_key:alpha:day").usage_key
    await store.refresh({day: 500}, ["r1"])
    assert await store.read_usage([day]) == {day: None}


async def test_keys_expire_after_their_period_plus_grace(store: Store, clock: Clock) -> None:
    p = keys_for()
    await warm(store, p, {"api_key:alpha:day": 1000}, settled=7)
    day = field_of(p, "api_key:alpha:day").usage_key
    clock.now = datetime(2026, 10, 1, tzinfo=UTC) + GRACE - timedelta(seconds=1)
    assert await store.read_usage([day]) == {day: 7}
    clock.now += timedelta(seconds=2)
    assert await store.read_usage([day]) == {day: None}


async def test_closed_period_key_is_never_recreated(store: Store, clock: Clock) -> None:
    p = keys_for()
    clock.now = T0 + timedelta(days=5)  # far past Sep 30 + grace
    await warm(store, p, {"api_key:alpha:day": 1000})
    day = field_of(p, "api_key:alpha:day").usage_key
    assert await store.read_usage([day]) == {day: None}
    assert await store.postflight("r1", 5, [day]) == 0


async def test_policy_cache_expires_after_its_ttl_and_can_be_evicted(
    store: Store, clock: Clock
) -> None:
    p = keys_for()
    await store.fill(p, {}, [], policy_ttl=60)
    clock.now = T0 + timedelta(seconds=61)
    assert (await store.preflight(p)).missing_policy
    await store.fill(p, {}, [], policy_ttl=60)
    await store.evict_policy("acme", "quota")
    assert (await store.preflight(p)).missing_policy


async def test_full_store_refuses_new_keys(make_store: StoreFactory, clock: Clock) -> None:
    small = make_store(clock, max_keys=2)
    p = keys_for()
    with pytest.raises(StoreFull):
        await warm(small, p, {"api_key:alpha:day": 1, "team:month": 1})
    # Nothing partial was written: the request is refused, never allowed untracked.
    assert (await small.preflight(p)).missing_policy


async def test_amounts_near_2_pow_53_stay_exact(store: Store) -> None:
    p = keys_for()
    big = 2**53 - 7
    await warm(store, p, {"api_key:alpha:day": 2**62}, settled=big)
    day = field_of(p, "api_key:alpha:day").usage_key
    await store.postflight("r1", 300_000_000, [day])
    assert await store.read_usage([day]) == {day: big + 300_000_000}


async def test_hostile_ids_do_not_share_keys(store: Store) -> None:
    ids = ["a:b", "a}b", "a{b", "a\nb", "a%3Ab", "x" * 10_000, "é", "e\u0301"]
    seen: set[str] = set()
    for raw in ids:
        p = keys_for(team=raw, key=raw)
        for cand in p.candidates:
            assert cand.usage_key not in seen
            seen.add(cand.usage_key)
            # one hash tag per key, holding exactly the encoded team
            assert cand.usage_key.count("{") == 1 and cand.usage_key.count("}") == 1
            assert "\n" not in cand.usage_key and len(cand.usage_key) < 300
