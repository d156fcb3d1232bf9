"""The store contract's rolling windows (budgets), on every store (the harness in conftest.py).

Time is whatever the caller says (``now_ms`` in every call), so draining and hold expiry run on
an injected clock everywhere, Redis included.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spendguard.errors import StoreFull, StoreUnavailable
from spendguard.limits import KeyCodec
from spendguard.limits.model import BudgetLimit, SubjectKind, Unit
from spendguard.limits.windows import SLICES, Period, Rolling
from spendguard.store import MemoryStore, RedisStore, Store
from spendguard.store.rolling import Bucket, BucketCheck, Commit, Hold, WindowCheck
from tests.store.conftest import Harness
from tests.support import RedisCluster

pytestmark = pytest.mark.anyio

HOUR = Rolling("hourly", "1h", 3600)  # 60 slices of one minute
DAY = Rolling("daily", "24h", 86_400)
KEY = Bucket(SubjectKind.API_KEY, "acme:alpha")
MODEL = Bucket(SubjectKind.MODEL, "gpt-4o")
FLEET = Bucket(SubjectKind.FLEET, "")
END_USER = Bucket(SubjectKind.END_USER, "acme:eve")
TAG = Bucket(SubjectKind.TAG, "batch")
CUSTOMER = Bucket(SubjectKind.CUSTOMER, "globex")
T0 = 1_800_000_000_000  # ms, on a slice boundary of both windows
MINUTE = 60_000


def tokens(limit: int, *windows: Rolling, bucket: Bucket = KEY) -> BucketCheck:
    return BucketCheck(bucket, tuple(WindowCheck(w, BudgetLimit(tokens=limit)) for w in windows))


def hold(now_ms: int, n: int, *, cost: int = 0, hold_ms: int = 600_000, id: str = "") -> Hold:
    return Hold(
        id=id or uuid.uuid4().hex,
        now_ms=now_ms,
        expires_ms=now_ms + hold_ms,
        tokens=n,
        cost=cost,
        count_cost=cost > 0,
        ttl_ms=DAY.period_ms + hold_ms,
    )


@pytest.fixture
def store(harness: Harness) -> Store:
    return harness.store


async def commit(
    store: Store, call: BucketCheck, h: Hold, used: int, *, now_ms: int | None = None
) -> None:
    await store.commit_buckets(
        [call],
        h.id,
        now_ms=now_ms or h.now_ms,
        at_ms=h.now_ms,
        tokens=used,
        cost=0,
        ttl_ms=h.ttl_ms,
    )


async def test_reserve_counts_holds_until_they_are_replaced(store: Store) -> None:
    call = tokens(100, HOUR, DAY)
    first = hold(T0, 60)
    [ok] = await store.reserve_buckets([call], first)
    assert ok.ok and ok.used_tokens == (60, 60)
    [denied] = await store.reserve_buckets([call], hold(T0, 50))
    assert not denied.ok and denied.window == 0 and denied.unit is Unit.TOKENS
    # Replaced by what was actually used: 10 tokens, not the 60 reserved.
    await commit(store, call, first, 10)
    [ok2] = await store.reserve_buckets([call], hold(T0, 90))
    assert ok2.ok and ok2.used_tokens == (100, 100)


async def test_release_returns_the_hold(store: Store) -> None:
    call = tokens(100, HOUR)
    h = hold(T0, 100)
    assert (await store.reserve_buckets([call], h))[0].ok
    assert not (await store.reserve_buckets([call], hold(T0, 1)))[0].ok
    await store.release_buckets([KEY], h.id)
    assert (await store.reserve_buckets([call], hold(T0, 100)))[0].ok


async def test_commit_replaces_a_hold_exactly_once(store: Store) -> None:
    call = tokens(100, HOUR)
    h = hold(T0, 50)
    await store.reserve_buckets([call], h)
    await commit(store, call, h, 30)
    await store.release_buckets([KEY], h.id)  # a late release after the commit changes nothing
    usage = await store.inspect_bucket(call, T0)
    assert (usage.held_tokens, usage.windows[0].tokens) == (0, 30)


async def test_a_rolling_window_drains_slice_by_slice(store: Store) -> None:
    call = tokens(100, HOUR)
    # 40 tokens at minute 0, 60 at minute 10: the hour is full.
    for minute, used in ((0, 40), (10, 60)):
        h = hold(T0 + minute * MINUTE, used)
        assert (await store.reserve_buckets([call], h))[0].ok
        await commit(store, call, h, used)
    at = T0 + 30 * MINUTE
    [denied] = await store.reserve_buckets([call], hold(at, 30))
    # The minute-0 slice leaves at minute 60: 30 minutes from now.
    assert not denied.ok and denied.retry_ms == 30 * MINUTE
    # One millisecond before it leaves: still full. At minute 60: 40 tokens free, no more.
    assert not (await store.reserve_buckets([call], hold(T0 + 60 * MINUTE - 1, 1)))[0].ok
    assert (await store.reserve_buckets([call], hold(T0 + 60 * MINUTE, 40)))[0].ok
    assert not (await store.reserve_buckets([call], hold(T0 + 60 * MINUTE, 1)))[0].ok
    usage = await store.inspect_bucket(call, T0 + 70 * MINUTE)
    assert usage.windows[0].tokens == 0  # minute 10's slice is gone too (and no commits since)


async def test_holds_in_the_way_ask_for_a_retry_in_a_second(store: Store) -> None:
    call = tokens(100, HOUR)
    assert (await store.reserve_buckets([call], hold(T0, 80)))[0].ok
    [denied] = await store.reserve_buckets([call], hold(T0, 30))
    assert not denied.ok and denied.retry_ms == 1000


async def test_a_hold_left_by_a_dead_request_expires(store: Store) -> None:
    call = tokens(100, HOUR)
    assert (await store.reserve_buckets([call], hold(T0, 100, hold_ms=5000)))[0].ok
    assert not (await store.reserve_buckets([call], hold(T0 + 4999, 1)))[0].ok
    assert (await store.reserve_buckets([call], hold(T0 + 5000, 100)))[0].ok


async def test_holds_expire_one_by_one_at_their_own_times(store: Store) -> None:
    """Forty holds expiring a second apart, every fourth committed first: at each moment the
    bucket holds exactly those that neither expired nor were committed, and only the expired
    ones stop counting (the search for expired holds runs when the earliest is due, and
    whatever it finds, it finds each hold once)."""
    call = tokens(10**9, HOUR)
    held = [hold(T0, 10 + i, hold_ms=1000 * (i + 1)) for i in range(40)]
    for h in held:
        assert (await store.reserve_buckets([call], h))[0].ok
    committed = set(range(0, 40, 4))
    for i in sorted(committed):
        await commit(store, call, held[i], 1, now_ms=T0 + 1)
    for at in (T0 + 500, T0 + 1000, T0 + 7_500, T0 + 20_000, T0 + 39_999, T0 + 40_000):
        live = [10 + i for i, h in enumerate(held) if i not in committed and h.expires_ms > at]
        usage = await store.inspect_bucket(call, at)
        assert (usage.held_tokens, usage.held_requests) == (sum(live), len(live)), at
        assert usage.windows[0].tokens == len(committed)
    # An expired hold's late commit still counts its usage (it is no longer held).
    await commit(store, call, held[1], 5, now_ms=T0 + 40_001)
    usage = await store.inspect_bucket(call, T0 + 40_001)
    assert usage.held_tokens == 0 and usage.windows[0].tokens == len(committed) + 5


async def test_every_window_must_afford_it(store: Store) -> None:
    call = BucketCheck(
        KEY,
        (
            WindowCheck(HOUR, BudgetLimit(tokens=1000)),
            WindowCheck(DAY, BudgetLimit(tokens=100)),
        ),
    )
    [denied] = await store.reserve_buckets([call], hold(T0, 150))
    assert not denied.ok and denied.window == 1
    # More than the limit itself never fits: the whole period.
    assert denied.retry_ms == DAY.period_ms


async def test_cost_limits_apply_only_to_priced_requests(store: Store) -> None:
    call = BucketCheck(KEY, (WindowCheck(HOUR, BudgetLimit(cost_micros=1000)),))
    assert not (await store.reserve_buckets([call], hold(T0, 10, cost=1001)))[0].ok
    priced = hold(T0, 10, cost=1000)
    assert (await store.reserve_buckets([call], priced))[0].ok
    [denied] = await store.reserve_buckets([call], hold(T0, 10, cost=1))
    assert not denied.ok and denied.unit is Unit.USD
    unpriced = hold(T0, 10)  # count_cost False
    assert (await store.reserve_buckets([call], unpriced))[0].ok


async def test_buckets_are_independent_and_reset_clears_one(store: Store) -> None:
    # Every kind of bucket, including those sharing their team's or the shared slot.
    every = (KEY, END_USER, TAG, CUSTOMER, MODEL, FLEET)
    calls = [tokens(10, HOUR, bucket=b) for b in every]
    h = hold(T0, 10)
    assert all(r.ok for r in await store.reserve_buckets(calls, h))
    for call in calls:
        await commit(store, call, h, 10)
    await store.reset_bucket(MODEL, [HOUR])
    await store.reset_bucket(KEY, [HOUR])
    answers = await store.reserve_buckets(calls, hold(T0, 10))
    assert [r.ok for r in answers] == [True, False, False, False, True, False]
    assert set(await store.buckets()) >= set(every)


async def test_usage_of_a_request_lands_in_its_start_slice(store: Store) -> None:
    call = tokens(100, HOUR)
    h = hold(T0, 50)
    await store.reserve_buckets([call], h)
    # It ends 59 minutes later: counted at minute 0, so it leaves the window at minute 60.
    await commit(store, call, h, 50, now_ms=T0 + 59 * MINUTE)
    assert (await store.inspect_bucket(call, T0 + 59 * MINUTE)).windows[0].tokens == 50
    assert (await store.inspect_bucket(call, T0 + 60 * MINUTE)).windows[0].tokens == 0


async def test_windows_have_sixty_slices() -> None:
    assert HOUR.slice_ms * SLICES == HOUR.period_ms == 3_600_000


async def test_memory_tracker_is_bounded() -> None:
    store = MemoryStore(max_keys=2)
    await store.reserve_buckets([tokens(10, HOUR, bucket=KEY)], hold(T0, 1))
    await store.reserve_buckets([tokens(10, HOUR, bucket=MODEL)], hold(T0, 1))
    with pytest.raises(StoreFull):
        await store.reserve_buckets([tokens(10, HOUR, bucket=FLEET)], hold(T0, 1))


async def test_memory_tracker_forgets_drained_buckets_when_full() -> None:
    store = MemoryStore(max_keys=1)
    h = hold(T0, 1, hold_ms=1000)
    await store.reserve_buckets([tokens(10, HOUR, bucket=KEY)], h)
    # Two hours later the key's bucket is empty (hold expired, nothing committed): room.
    assert (await store.reserve_buckets([tokens(10, HOUR, bucket=MODEL)], hold(T0 + 7_200_000, 1)))[
        0
    ].ok


async def test_redis_down_is_store_unavailable() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1", prefix="x", timeout=0.2)
    try:
        with pytest.raises(StoreUnavailable):
            await store.reserve_buckets([tokens(10, HOUR)], hold(T0, 1))
    finally:
        await store.aclose()


async def test_cluster_buckets_live_in_their_teams_slot_or_the_shared_one(
    redis_cluster: RedisCluster,
) -> None:
    """A key's and an end user's bucket share their team's slot (its spend keys'), a model's
    and the fleet's the provider pool's: a request's round touches two slots at most."""
    store = RedisStore.from_url(redis_cluster.url, prefix="slot", timeout=2.0)
    codec = KeyCodec("slot", timedelta(hours=1))
    try:
        slots = {
            b: {redis_cluster.slot_of(k) for k in store.bucket_keys(b, (HOUR, DAY))}
            for b in (KEY, END_USER, TAG, CUSTOMER, MODEL, FLEET)
        }
        team = redis_cluster.slot_of(codec.policy_key("acme"))
        shared = redis_cluster.slot_of(store.pool_key("any"))
    finally:
        await store.aclose()
    assert all(len(s) == 1 for s in slots.values())
    assert slots[KEY] == slots[END_USER] == {team}
    assert slots[MODEL] == slots[FLEET] == {shared}
    assert team != shared and len({*slots[TAG], *slots[CUSTOMER], team, shared}) == 4


async def test_running_totals_agree_with_the_slices_as_time_moves(store: Store) -> None:
    """A long, random run of commits, reserves and releases over two windows, with time jumping
    past slices (and past whole windows): every answer and every inspection equals that of the
    memory store, which sums its slices afresh on every call. On Redis the windows keep running
    totals that only a slice leaving the window (or a denial) walks the slices for."""
    import random

    reference = MemoryStore(max_keys=10)
    rng = random.Random(27)
    call = BucketCheck(
        KEY,
        (
            WindowCheck(HOUR, BudgetLimit(tokens=5_000, cost_micros=900_000)),
            WindowCheck(DAY, BudgetLimit(tokens=40_000)),
        ),
    )
    now = T0
    for step in range(400):
        now += rng.choice((1, 500, MINUTE // 3, MINUTE, 7 * MINUTE, 61 * MINUTE))
        h = hold(now, rng.randint(1, 400), cost=rng.randint(0, 20_000), id=f"h{step}")
        [got] = await store.reserve_buckets([call], h)
        [want] = await reference.reserve_buckets([call], h)
        assert (got.ok, got.used_tokens, got.window, got.unit, got.retry_ms) == (
            want.ok,
            want.used_tokens,
            want.window,
            want.unit,
            want.retry_ms,
        ), step
        if got.ok:
            if rng.random() < 0.2:
                await store.release_buckets([KEY], h.id)
                await reference.release_buckets([KEY], h.id)
            else:
                used, cost = rng.randint(0, 500), rng.randint(0, 30_000)
                late = now + rng.randint(0, 1)
                for s in (store, reference):
                    await s.commit_buckets(
                        [call],
                        h.id,
                        now_ms=late,
                        at_ms=h.now_ms,
                        tokens=used,
                        cost=cost,
                        ttl_ms=h.ttl_ms,
                    )
        if step % 10 == 0:
            assert await store.inspect_bucket(call, now) == await reference.inspect_bucket(
                call, now
            ), step


async def test_a_window_written_before_running_totals_gets_them(redis_url: str) -> None:
    """A bucket an earlier release wrote has slices but no totals: its first reserve walks the
    slices and writes them, and from then on commits keep them."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(redis_url, prefix=prefix, timeout=2.0)
    try:
        call = tokens(100, HOUR)
        window_key = store.bucket_keys(KEY, (HOUR,))[1]
        slice_now = T0 // HOUR.slice_ms
        client: Any = store.client
        await client.hset(window_key, mapping={f"t{slice_now}": "60", f"t{slice_now - 1}": "30"})
        [denied] = await store.reserve_buckets([call], hold(T0, 11))
        assert not denied.ok  # 90 of 100 counted from the slices
        assert await client.hmget(window_key, ["_T", "_C", "_F"]) == ["90", "0", str(slice_now - 1)]
        h = hold(T0, 10)
        assert (await store.reserve_buckets([call], h))[0].ok
        await commit(store, call, h, 4)
        assert await client.hget(window_key, "_T") == "94"
        assert (await store.inspect_bucket(call, T0)).windows[0].tokens == 94
    finally:
        await store.aclose()


async def test_every_bucket_key_keeps_a_lifetime_longer_than_its_usage(redis_url: str) -> None:
    """The scripts renew a bucket's lifetimes once a sixteenth of its ttl has passed, not on
    every call, so each key they create must get a lifetime of its own: the holds hash, a
    window first written by a commit."""
    store = RedisStore.from_url(redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", timeout=2.0)
    client: Any = store.client
    call = tokens(10**6, HOUR, DAY)
    keys = store.bucket_keys(KEY, (HOUR, DAY))
    ttl = hold(T0, 1).ttl_ms

    async def lifetimes() -> list[int]:
        return [await client.pttl(k) for k in keys]  # -2: no such key, -1: no lifetime

    async def admitted(h: Hold, used: int) -> None:
        assert (await store.reserve_buckets([call], h))[0].ok
        assert all(t == -2 or t > ttl for t in await lifetimes()), await lifetimes()
        await commit(store, call, h, used, now_ms=h.now_ms + 1)
        assert all(t == -2 or t > ttl for t in await lifetimes()), await lifetimes()

    try:
        await admitted(hold(T0, 10), 5)  # the windows are written first by this commit
        await admitted(hold(T0 + 2, 10), 5)  # renewal not due
        await client.delete(*keys[1:])  # the windows lapse (a reset)
        await admitted(hold(T0 + 4, 10), 5)
        now = await lifetimes()
        assert now[0] > ttl and min(now[1:]) > ttl  # the windows have lifetimes again
        # Renewal is due a sixteenth of the ttl after the last one, then for every key at once.
        assert (await store.reserve_buckets([call], hold(T0 + 5, 10)))[0].ok  # stays open
        for k in keys:
            await client.pexpire(k, 60_000)
        assert (await store.reserve_buckets([call], hold(T0 + 6, 10)))[0].ok
        assert max(await lifetimes()) <= 60_000  # not due yet: nothing renewed
        later = hold(T0 + ttl // 16, 10)
        assert (await store.reserve_buckets([call], later))[0].ok
        assert min(await lifetimes()) > ttl
        assert (await store.inspect_bucket(call, later.now_ms)).windows[1].tokens == 5
    finally:
        await store.aclose()


async def test_a_hold_written_without_the_earliest_expiry_mark_still_expires(
    redis_url: str,
) -> None:
    """Reserves look for expired holds only once the earliest may have expired (the holds
    hash's _n); a bucket an earlier release wrote has no _n and is searched at once."""
    store = RedisStore.from_url(redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", timeout=2.0)
    client: Any = store.client
    call = tokens(100, HOUR)
    try:
        assert (await store.reserve_buckets([call], hold(T0, 100, hold_ms=5000)))[0].ok
        await client.hdel(store.bucket_keys(KEY, (HOUR,))[0], "_n")
        assert not (await store.reserve_buckets([call], hold(T0 + 4999, 1)))[0].ok
        assert (await store.reserve_buckets([call], hold(T0 + 5000, 100)))[0].ok
    finally:
        await store.aclose()


async def test_a_commit_held_only_counts_where_the_hold_still_is_and_only_once(
    store: Store,
) -> None:
    # Recovery of a dead gateway's admission: its hold becomes the charge once, however often
    # the admission is recovered, and not where the gateway's own commit got there first.
    held, committed = tokens(1000, HOUR), tokens(1000, HOUR, bucket=MODEL)
    h = hold(T0, 300, id="0190f0aa00000000000000000000abcd")
    assert all(a.ok for a in await store.reserve_buckets([held, committed], h))
    await commit(store, committed, h, 40)  # the gateway's own commit reached this bucket

    async def recover(calls: list[BucketCheck]) -> None:
        await store.commit_buckets(
            calls,
            h.id,
            now_ms=T0 + MINUTE,
            at_ms=T0,
            tokens=25,
            cost=0,
            ttl_ms=h.ttl_ms,
            held_only=True,
        )

    for _ in range(2):  # the same admission recovered twice
        await recover([held, committed])
    key_usage = await store.inspect_bucket(held, T0 + MINUTE)
    model_usage = await store.inspect_bucket(committed, T0 + MINUTE)
    assert (key_usage.held_tokens, key_usage.windows[0].tokens) == (0, 25)
    assert (model_usage.held_tokens, model_usage.windows[0].tokens) == (0, 40)
    # A bucket that never held it counts nothing either.
    await recover([tokens(1000, HOUR, bucket=FLEET)])
    fleet = await store.inspect_bucket(tokens(1000, HOUR, bucket=FLEET), T0 + MINUTE)
    assert fleet.windows[0].tokens == 0


async def test_a_denial_tells_the_least_left_in_any_window_per_unit(store: Store) -> None:
    # What a smaller request could still take (fit instead of refuse): holds count as used.
    call = BucketCheck(
        KEY,
        (
            WindowCheck(HOUR, BudgetLimit(tokens=1_000, cost_micros=500)),
            WindowCheck(DAY, BudgetLimit(tokens=800)),
        ),
    )
    first = hold(T0, 300, cost=100)
    assert (await store.reserve_buckets([call], first))[0].ok
    await commit(store, call, first, 250)  # 250 tokens counted, cost as committed: 0
    assert (await store.reserve_buckets([call], hold(T0, 100, cost=50)))[0].ok  # a live hold
    [denied] = await store.reserve_buckets([call], hold(T0, 600, cost=10))
    assert not denied.ok and (denied.window, denied.unit) == (1, Unit.TOKENS)
    # The day has 800 - 250 - 100 left; the hour's cost 500 - 0 - 50.
    assert (denied.left_tokens, denied.left_cost) == (450, 450)
    [tokens_only] = await store.reserve_buckets([tokens(300, HOUR, bucket=MODEL)], hold(T0, 400))
    assert (tokens_only.left_tokens, tokens_only.left_cost) == (300, None)


async def test_a_requests_limit_counts_holds_and_commits_one_each(store: Store) -> None:
    # Requests per window: a rolling RPM in a one-minute window; every hold is one request
    # until its commit counts it in its start slice (a release gives it back).
    minute = Rolling("minute", "1m", 60)  # slices of a second
    call = BucketCheck(
        KEY,
        (
            WindowCheck(minute, BudgetLimit(requests=3)),
            WindowCheck(HOUR, BudgetLimit(tokens=1_000_000)),
        ),
    )
    holds = [hold(T0, 10) for _ in range(3)]
    for h in holds:
        assert (await store.reserve_buckets([call], h))[0].ok
    [denied] = await store.reserve_buckets([call], hold(T0, 10))
    assert not denied.ok and (denied.window, denied.unit) == (0, Unit.REQUESTS)
    assert denied.retry_ms == 1000  # only holds in the way: a second
    await store.release_buckets([KEY], holds[0].id)
    assert (await store.reserve_buckets([call], hold(T0, 10)))[0].ok  # its request given back
    await commit(store, call, holds[1], 7)
    await commit(store, call, holds[2], 7)
    usage = await store.inspect_bucket(call, T0 + 500)
    assert [w.requests for w in usage.windows] == [2, 2]
    assert (usage.held_requests, usage.windows[1].tokens) == (1, 14)
    # Two committed in slice T0 and one held: the window is full until that slice leaves it.
    [later] = await store.reserve_buckets([call], hold(T0 + 30_000, 10))
    assert not later.ok and later.retry_ms == 30_000
    [after] = await store.reserve_buckets([call], hold(T0 + 60_000, 10))
    assert after.ok  # the committed two left the minute; the live hold still counts


async def test_a_seeded_bucket_counts_the_ledgers_requests(harness: Harness) -> None:
    store = harness.store
    if not store.shared:
        pytest.skip("an in-process bucket is never lost, so never seeded")
    minute = Rolling("minute", "1m", 60)
    call = BucketCheck(KEY, (WindowCheck(minute, BudgetLimit(requests=5)),))
    idx = T0 // minute.slice_ms
    assert await store.seed_bucket(call, [[(idx - 1, 30, 0, 3), (idx, 10, 0, 1)]], 120_000)
    usage = await store.inspect_bucket(call, T0)
    assert (usage.windows[0].tokens, usage.windows[0].requests) == (40, 4)
    assert (await store.reserve_buckets([call], hold(T0, 1), require_seed=True))[0].ok
    [full] = await store.reserve_buckets([call], hold(T0, 1), require_seed=True)
    assert not full.ok and full.unit is Unit.REQUESTS


async def test_a_calendar_window_empties_at_utc_midnight_and_on_the_first(store: Store) -> None:
    # utc:day / utc:month: the period of the request's start, as spend limits count, not the
    # last 24 hours: everything in it leaves at once when the period resets.
    day = Rolling("today", "utc:day", 86_400, Period.DAY)
    month = Rolling("this-month", "utc:month", 31 * 86_400, Period.MONTH)
    call = BucketCheck(
        KEY,
        (WindowCheck(day, BudgetLimit(tokens=100)), WindowCheck(month, BudgetLimit(tokens=250))),
    )
    late = int(datetime(2026, 1, 31, 23, 30, tzinfo=UTC).timestamp() * 1000)
    first = hold(late, 80)
    assert (await store.reserve_buckets([call], first))[0].ok
    await commit(store, call, first, 80)
    [denied] = await store.reserve_buckets([call], hold(late + 60_000, 30))
    assert not denied.ok and (denied.window, denied.unit) == (0, Unit.TOKENS)
    assert denied.retry_ms == 29 * 60_000  # at midnight, not a slice at a time
    feb = late + 30 * 60_000 + 1  # 00:00:00.001 on 1 Feb: a new day and a new month
    usage = await store.inspect_bucket(call, feb)
    assert [w.tokens for w in usage.windows] == [0, 0]
    # A request that started in January and ends in February counts for January only.
    january = hold(late + 120_000, 40)
    assert (await store.reserve_buckets([call], january))[0].ok
    await commit(store, call, january, 40, now_ms=feb)
    assert [w.tokens for w in (await store.inspect_bucket(call, feb)).windows] == [0, 0]
    for days in (1, 26):  # 2 Feb, then 27 Feb: the day resets, the month does not
        at = feb + days * 86_400_000
        h = hold(at, 100)
        assert (await store.reserve_buckets([call], h))[0].ok
        await commit(store, call, h, 100)
    [full] = await store.reserve_buckets([call], hold(feb + 27 * 86_400_000 + 1000, 60))  # 28 Feb
    assert not full.ok and full.window == 1  # the month: 200 + 60 > 250
    assert full.retry_ms == 86_400_000 - 1001  # until 1 March


def ids(n: int, tag: str = "s") -> list[str]:
    return [f"{tag}{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]


async def test_stocked_holds_leave_a_share_free_for_everyone_else(store: Store) -> None:
    call = tokens(1000, HOUR, DAY)
    size = hold(T0, 10)
    # 1000 free: at most 1000 / (10 * (4 + 1)) = 20 holds keep four times theirs free.
    assert await store.stock_bucket(call, size, ids(8), 4) == 8
    usage = await store.inspect_bucket(call, T0)
    assert (usage.held_tokens, usage.held_requests) == (80, 8)
    # 920 free now: 18 more at most, the first ones of those asked for.
    asked = ids(30)
    assert await store.stock_bucket(call, size, asked, 4) == 18
    usage = await store.inspect_bucket(call, T0)
    assert usage.held_tokens == 260
    # They are holds like any other: 740 is what a request may still reserve.
    assert not (await store.reserve_buckets([call], hold(T0, 741)))[0].ok
    assert (await store.reserve_buckets([call], hold(T0, 740)))[0].ok
    # Nothing is free: nothing more is stocked.
    assert await store.stock_bucket(call, size, ids(4), 4) == 0


async def test_every_unit_and_window_bounds_the_stock(store: Store) -> None:
    minute = Rolling("minute", "1m", 60)
    call = BucketCheck(
        MODEL,
        (
            WindowCheck(minute, BudgetLimit(requests=12)),
            WindowCheck(HOUR, BudgetLimit(tokens=10**9, cost_micros=1_000)),
        ),
    )
    # Requests: 12 / (1 * 3) = 4; cost: 1000 / (50 * 3) = 6; tokens: plenty.
    assert await store.stock_bucket(call, hold(T0, 10, cost=50), ids(10), 2) == 4
    # An unpriced request's holds cost nothing: only the requests bound them (8 left: 2).
    assert await store.stock_bucket(call, hold(T0, 10), ids(10), 2) == 2


async def test_a_stocked_hold_is_committed_released_and_expires_by_its_id(store: Store) -> None:
    call = tokens(10_000, HOUR, bucket=FLEET)
    size = hold(T0, 100, hold_ms=5000)
    stock = ids(5)
    assert await store.stock_bucket(call, size, stock, 1) == 5
    # A request took the first: its commit replaces that hold by its usage, once.
    taken = Hold(stock[0], T0, size.expires_ms, 100, 0, False, size.ttl_ms)
    await commit(store, call, taken, 7, now_ms=T0 + 10)
    usage = await store.inspect_bucket(call, T0 + 10)
    assert (usage.held_tokens, usage.windows[0].tokens) == (400, 7)
    # The second was taken and refused elsewhere: released like a reserved hold.
    await store.release_buckets([FLEET], stock[1])
    # The rest go back together; one already gone is not counted twice.
    assert await store.release_stock(FLEET, stock[1:4]) == 2
    usage = await store.inspect_bucket(call, T0 + 20)
    assert (usage.held_tokens, usage.held_requests) == (100, 1)
    # The last one lapses with its expiry, as a dead gateway's would.
    assert (await store.reserve_buckets([call], hold(T0 + 5000, 9_993)))[0].ok


async def test_several_holds_committed_at_once_count_as_committed_one_by_one(
    store: Store,
) -> None:
    """``commit_holds``: the finishes a gateway carried together, one call for a bucket. Each
    hold goes, each request's usage lands in its own start's slice (two slices here, and one
    request whose slice already left the hour: counted in the day only), as one commit each
    would have left it; a hold already gone still counts its usage, as one commit would."""
    together = tokens(10**6, HOUR, DAY, bucket=MODEL)
    apart = tokens(10**6, HOUR, DAY, bucket=FLEET)
    now = T0 + 90 * MINUTE
    starts = [T0 + 90 * MINUTE, T0 + 89 * MINUTE, T0 + 89 * MINUTE, T0 + 10 * MINUTE]
    holds = [hold(at, 500) for at in starts]
    for call in (together, apart):
        for h in holds[:3]:  # the last one's hold expired: not there any more
            [ok] = await store.reserve_buckets([call], h)
            assert ok.ok
    used = [30, 40, 50, 60]
    assert (
        await store.commit_holds(
            together,
            [Commit(h.id, h.now_ms, n, n * 10) for h, n in zip(holds, used, strict=True)],
            now_ms=now,
            ttl_ms=holds[0].ttl_ms,
        )
        == 0  # no thresholds: nothing fired
    )
    for h, n in zip(holds, used, strict=True):
        await store.commit_buckets(
            [apart], h.id, now_ms=now, at_ms=h.now_ms, tokens=n, cost=n * 10, ttl_ms=h.ttl_ms
        )
    got = await store.inspect_bucket(together, now)
    want = await store.inspect_bucket(apart, now)
    assert got.held_tokens == want.held_tokens == 0
    counted = [(w.tokens, w.cost, w.requests) for w in got.windows]
    assert counted == [(120, 1200, 3), (180, 1800, 4)]
    assert counted == [(w.tokens, w.cost, w.requests) for w in want.windows]
