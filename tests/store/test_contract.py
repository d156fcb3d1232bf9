"""One contract, every store (the harness in conftest.py): spend limits, balances, rates and
model lists. Expiry tests use sub-second TTLs to stay fast. Every test runs on asyncio's event
loop and on uvloop (uvicorn's default wherever it is installed).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from spendguard.errors import StoreFull
from spendguard.identity import Identity
from spendguard.limits import Balance, KeyCodec, KeyPlan, Period, Target, key_limit, team_limit
from spendguard.limits.codec import field_of
from spendguard.limits.model import SubjectKind
from spendguard.limits.rates import RateKind, Rates, rate_field
from spendguard.store import CachedParts, EntryWrite, Outcome, RefreshEntry, UsageFill
from spendguard.store.memory import MemoryStore
from tests.store.conftest import Harness

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]

GRACE = timedelta(days=2)
ALPHA = Identity("acme", "alpha")
KEY_DAY, KEY_MONTH = key_limit(ALPHA, Period.DAY), key_limit(ALPHA, Period.MONTH)
TEAM_MONTH = team_limit(ALPHA, Period.MONTH)
BALANCE = Balance(ALPHA.team)


def fields(limits: dict[Target, int]) -> dict[str, int]:
    """A team's policy hash, as the engine writes it (through the codec)."""
    return {field_of(target): amount for target, amount in limits.items()}


def keys_for(h: Harness, team: str = "acme", key: str | None = "alpha", **kw: object) -> KeyPlan:
    t0 = kw.get("t0", h.now())
    grace = kw.get("grace", GRACE)
    return KeyCodec("quota", grace).plan(Identity(team, key), t0)  # type: ignore[arg-type]


def usage_key(p: KeyPlan, target: Target) -> str:
    return p.find(target).usage_key


async def warm(h: Harness, p: KeyPlan, limits: dict[Target, int], settled: int = 0) -> None:
    fills = [UsageFill(c.usage_key, settled, c.expires_at) for c in p.checks if c.target in limits]
    await h.store.fill(p, fields(limits), fills, policy_ttl=60)


async def test_empty_store_reports_a_policy_miss(harness: Harness) -> None:
    pf = await harness.store.preflight(keys_for(harness))
    assert pf.outcome is Outcome.MISS and pf.missing_policy


async def test_no_policy_is_cached_and_reads_no_usage(harness: Harness) -> None:
    p = keys_for(harness)
    await harness.store.fill(p, {}, [], policy_ttl=60)
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.ALLOW and pf.limits == ()
    # Nothing about usage was looked up or made: every usage key of the plan is still absent.
    keys = [c.usage_key for c in p.checks]
    assert await harness.store.read_usage(keys) == dict.fromkeys(keys)


async def test_policy_without_usage_key_reports_which_keys_miss(harness: Harness) -> None:
    p = keys_for(harness)
    await harness.store.fill(p, fields({TEAM_MONTH: 100}), [], policy_ttl=60)
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.MISS and not pf.missing_policy
    assert [c.target for c in pf.missing_usage] == [TEAM_MONTH]


@pytest.mark.parametrize(
    ("used", "limit", "outcome"), [(99, 100, "allow"), (100, 100, "deny"), (0, 0, "deny")]
)
async def test_usage_at_limit_denies_and_one_below_allows(
    harness: Harness, used: int, limit: int, outcome: str
) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: limit}, settled=used)
    pf = await harness.store.preflight(p)
    assert pf.outcome == outcome
    assert pf.limits[-1].used == used and pf.limits[-1].limit == limit


async def test_every_configured_limit_must_pass(harness: Harness) -> None:
    p = keys_for(harness)
    day, month = p.find(KEY_DAY), p.find(TEAM_MONTH)
    await harness.store.fill(
        p,
        fields({KEY_DAY: 5_000_000, TEAM_MONTH: 200_000_000}),
        [
            UsageFill(day.usage_key, 1, day.expires_at),
            UsageFill(month.usage_key, 200_000_000, month.expires_at),
        ],
        policy_ttl=60,
    )
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.DENY
    assert pf.denied is not None and pf.denied.check.target == TEAM_MONTH


async def test_postflight_adds_once_and_never_creates_keys(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 1000})
    day, month = usage_key(p, KEY_DAY), usage_key(p, TEAM_MONTH)
    assert await harness.store.postflight("r1", 40, [day, month]) == 1
    assert await harness.store.postflight("r1", 40, [day]) == 0  # a re-sent record adds nothing
    assert await harness.store.read_usage([day, month]) == {day: 40, month: None}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
async def test_postflight_validates_before_writing(harness: Harness, bad: object) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 1000})
    day = usage_key(p, KEY_DAY)
    with pytest.raises(ValueError):
        await harness.store.postflight("r1", bad, [day])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await harness.store.postflight("", 5, [day])
    assert await harness.store.read_usage([day]) == {day: 0}


async def test_fill_never_overwrites_what_postflight_added(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 1000}, settled=10)
    day = usage_key(p, KEY_DAY)
    await harness.store.postflight("r1", 5, [day])
    await warm(harness, p, {KEY_DAY: 1}, settled=0)  # a stale second loader
    assert await harness.store.read_usage([day]) == {day: 15}
    assert (await harness.store.preflight(p)).limits[0].limit == 1000


async def test_refresh_replaces_settled_and_drops_each_estimate_once(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 10_000}, settled=100)
    day = usage_key(p, KEY_DAY)
    await harness.store.postflight("r1", 30, [day])
    await harness.store.postflight("r2", 50, [day])
    # r1 settled at an exact charge of 32: settled 100 -> 132, pending keeps only r2.
    await harness.store.refresh([RefreshEntry(day, 132, ("r1",))])
    assert await harness.store.read_usage([day]) == {day: 182}
    await harness.store.refresh([RefreshEntry(day, 132, ("r1",))])  # idempotent
    assert await harness.store.read_usage([day]) == {day: 182}
    await harness.store.refresh([RefreshEntry(day, 132, ("never-applied",))])  # nothing to subtract
    assert await harness.store.read_usage([day]) == {day: 182}


async def test_unknown_postflight_outcome_never_leaves_an_estimate_behind(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 10_000})
    day = usage_key(p, KEY_DAY)
    # Settled while its postflight was still "unknown"; the postflight lands afterwards.
    await harness.store.refresh([RefreshEntry(day, 25, (), ("late",))])
    assert await harness.store.postflight("late", 25, [day]) == 0
    assert await harness.store.read_usage([day]) == {day: 25}
    # Unknown but in fact applied before the refresh: its marker goes, exactly once.
    await harness.store.postflight("early", 9, [day])
    await harness.store.refresh([RefreshEntry(day, 34, (), ("early",))])
    await harness.store.refresh([RefreshEntry(day, 34, (), ("early",))])
    assert await harness.store.read_usage([day]) == {day: 34}


async def test_a_refresh_of_thousands_of_records_drops_each_estimate_once(harness: Harness) -> None:
    # More records than a shared store removes in one call, over two keys, of both kinds:
    # applied (their markers go) and unknown (their markers go, or a tombstone waits).
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 10**12, TEAM_MONTH: 10**12}, settled=5)
    day, month = usage_key(p, KEY_DAY), usage_key(p, TEAM_MONTH)
    applied = [f"a{i:05d}" for i in range(2_300)]
    unknown_applied = [f"u{i:05d}" for i in range(700)]  # their postflight did land
    unknown_late = [f"l{i:05d}" for i in range(300)]  # it will land after the refresh
    kept = [f"k{i:05d}" for i in range(50)]  # not settled: their estimates stay
    for chunk in (applied, unknown_applied, kept):
        async with anyio.create_task_group() as tg:
            for rid in chunk:
                tg.start_soon(harness.store.postflight, rid, 3, [day, month])
    settled = 5 + 4 * (len(applied) + len(unknown_applied) + len(unknown_late))
    unknown = (*unknown_applied, *unknown_late)
    entries = [RefreshEntry(k, settled, tuple(applied), unknown) for k in (day, month)]
    await harness.store.refresh(entries)
    want = settled + 3 * len(kept)
    assert await harness.store.read_usage([day, month]) == {day: want, month: want}
    pending = await harness.store.pending_records([day, month])
    assert sorted(pending[day]) == kept and sorted(pending[month]) == kept
    await harness.store.refresh(entries)  # a rerun subtracts nothing twice
    for rid in unknown_late[:5]:  # a late postflight finds its tombstone
        assert await harness.store.postflight(rid, 3, [day, month]) == 0
    assert await harness.store.read_usage([day, month]) == {day: want, month: want}


async def test_refresh_never_lowers_settled(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 10_000}, settled=100)
    day = usage_key(p, KEY_DAY)
    await harness.store.postflight("r2", 7, [day])
    await harness.store.refresh([RefreshEntry(day, 300, ("r1",))])  # worker B, newer read
    await harness.store.refresh([RefreshEntry(day, 200, ("r0",))])  # worker A, older read
    assert await harness.store.read_usage([day]) == {day: 307}
    # Exact beyond 2**53: decimal strings compared by length, then lexically.
    await harness.store.refresh([RefreshEntry(day, 2**53 + 1)])
    await harness.store.refresh([RefreshEntry(day, 2**53)])
    assert await harness.store.read_usage([day]) == {day: 2**53 + 1 + 7}


async def test_refresh_does_not_create_absent_keys(harness: Harness) -> None:
    day = usage_key(keys_for(harness), KEY_DAY)
    await harness.store.refresh([RefreshEntry(day, 500, ("r1",))])
    assert await harness.store.read_usage([day]) == {day: None}


async def test_keys_expire_at_period_end_plus_grace(harness: Harness) -> None:
    now = harness.now()
    # A grace chosen so this day's key expires 2 s from now: room for the warm-up and the first
    # read on a loaded machine (a cluster's at 300 ms once expired before it was read).
    grace = now + timedelta(milliseconds=2000) - Period.DAY.end(now)
    p = keys_for(harness, grace=grace)
    await warm(harness, p, {KEY_DAY: 1000}, settled=7)
    day = usage_key(p, KEY_DAY)
    assert await harness.store.read_usage([day]) == {day: 7}
    await harness.advance(2.3)
    assert await harness.store.read_usage([day]) == {day: None}


async def test_closed_period_key_is_never_recreated(harness: Harness) -> None:
    p = keys_for(harness, t0=harness.now() - timedelta(days=10))
    await warm(harness, p, {KEY_DAY: 1000})
    day = usage_key(p, KEY_DAY)
    assert await harness.store.read_usage([day]) == {day: None}
    assert await harness.store.postflight("r1", 5, [day]) == 0
    assert await harness.store.read_usage([day]) == {day: None}


async def test_policy_cache_expires_after_its_ttl_and_can_be_evicted(harness: Harness) -> None:
    p = keys_for(harness)
    await harness.store.fill(p, {}, [], policy_ttl=0.3)
    await harness.advance(0.6)
    assert (await harness.store.preflight(p)).missing_policy
    await harness.store.fill(p, {}, [], policy_ttl=60)
    await harness.store.evict_policy(KeyCodec("quota", GRACE).policy_key(ALPHA.team))
    assert (await harness.store.preflight(p)).missing_policy


async def test_overwrites_keep_the_ttl(harness: Harness) -> None:
    now = harness.now()
    grace = now + timedelta(milliseconds=500) - Period.DAY.end(now)
    p = keys_for(harness, grace=grace)
    await warm(harness, p, {KEY_DAY: 1000})
    day = usage_key(p, KEY_DAY)
    await harness.store.postflight("r1", 5, [day])
    await harness.store.refresh([RefreshEntry(day, 3, ("r1",))])
    await harness.advance(0.8)
    assert await harness.store.read_usage([day]) == {day: None}


async def test_full_memory_store_refuses_new_keys() -> None:
    small = MemoryStore(max_keys=2)
    p = KeyCodec("quota", GRACE).plan(ALPHA, datetime.now(UTC))
    fills = [UsageFill(c.usage_key, 0, c.expires_at) for c in p.checks[:2]]
    with pytest.raises(StoreFull):
        await small.fill(p, fields({KEY_DAY: 1, KEY_MONTH: 1}), fills, policy_ttl=60)
    # Nothing partial was written: the request is refused, never allowed untracked.
    assert (await small.preflight(p)).missing_policy


@pytest.mark.parametrize("big", [2**53 - 7, 2**53 + 1, 9 * 10**17])
async def test_amounts_near_2_pow_53_stay_exact(harness: Harness, big: int) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: big + 300_000_001}, settled=big)
    day = usage_key(p, KEY_DAY)
    await harness.store.postflight("r1", 300_000_000, [day])
    assert await harness.store.read_usage([day]) == {day: big + 300_000_000}
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.ALLOW and pf.limits[0].used == big + 300_000_000
    await harness.store.postflight("r2", 1, [day])
    assert (await harness.store.preflight(p)).outcome is Outcome.DENY  # exactly at the limit


async def test_hostile_ids_do_not_share_keys(harness: Harness) -> None:
    ids = ["a:b", "a}b", "a{b", "a\nb", "a%3Ab", "x" * 10_000, "é", "e\u0301", "{", "}"]
    seen: set[str] = set()
    for n, raw in enumerate(ids):
        p = keys_for(harness, team=raw, key=raw)
        for cand in p.checks:
            assert cand.usage_key not in seen
            seen.add(cand.usage_key)
            assert cand.usage_key.count("{") == 1 and cand.usage_key.count("}") == 1
            assert "\n" not in cand.usage_key and len(cand.usage_key) < 300
        await warm(harness, p, {key_limit(Identity(raw, raw), Period.DAY): 1000}, settled=n)
    for n, raw in enumerate(ids):  # each id still reads back only its own usage
        p = keys_for(harness, team=raw, key=raw)
        pf = await harness.store.preflight(p)
        assert pf.outcome is Outcome.ALLOW and [s.used for s in pf.limits] == [n]


async def test_balance_denies_once_nothing_is_left(harness: Harness) -> None:
    p = keys_for(harness)
    bal = p.find(BALANCE)
    fill = UsageFill(bal.usage_key, 60, bal.expires_at, limit=100)
    await harness.store.fill(p, fields({BALANCE: 1}), [fill], policy_ttl=60)
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.ALLOW and (pf.limits[-1].limit, pf.limits[-1].used) == (100, 60)
    await harness.store.postflight("r1", 40, [bal.usage_key])
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.DENY and pf.denied is not None and pf.denied.check is bal
    # A top-up raises t; settlement raises s and drops the marker.
    await harness.store.refresh([RefreshEntry(bal.usage_key, 100, ("r1",), limit=150)])
    pf = await harness.store.preflight(p)
    assert pf.outcome is Outcome.ALLOW and (pf.limits[-1].limit, pf.limits[-1].used) == (150, 100)


async def test_pending_records_lists_the_markers_of_existing_keys(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 1000, TEAM_MONTH: 1000})
    day, month = usage_key(p, KEY_DAY), usage_key(p, TEAM_MONTH)
    absent = usage_key(p, KEY_MONTH)
    await harness.store.postflight("r1", 5, [day, month])
    await harness.store.postflight("r2", 6, [day])
    got = await harness.store.pending_records([day, month, absent])
    assert sorted(got[day]) == ["r1", "r2"] and got[month] == ["r1"] and absent not in got
    await harness.store.refresh([RefreshEntry(day, 5, ("r1",))])
    assert (await harness.store.pending_records([day]))[day] == ["r2"]


async def test_pending_records_lists_every_marker_of_a_large_key_once(harness: Harness) -> None:
    # More markers than a shared store reads in one page, some settled meanwhile: each pending
    # one is listed exactly once, and a settled one not at all.
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 10**12, TEAM_MONTH: 10**12})
    day, month = usage_key(p, KEY_DAY), usage_key(p, TEAM_MONTH)
    ids = [f"rec{i:05d}" for i in range(4_500)]
    for start in range(0, len(ids), 500):
        async with anyio.create_task_group() as tg:
            for rid in ids[start : start + 500]:
                tg.start_soon(harness.store.postflight, rid, 1, [day, month])
    settled = ids[::7]
    await harness.store.refresh([RefreshEntry(day, len(settled), tuple(settled))])
    got = await harness.store.pending_records([day, month])
    assert sorted(got[day]) == sorted(set(ids) - set(settled)) and len(got[day]) == len(ids) - len(
        settled
    )
    assert sorted(got[month]) == ids


ENTRIES = "quota:{acme}:spend:open"


def entry(rid: str, value: str = "v") -> EntryWrite:
    return EntryWrite(ENTRIES, rid, value)


async def test_an_admission_entry_is_written_exactly_when_the_request_is_allowed(
    harness: Harness,
) -> None:
    p = keys_for(harness)
    store = harness.store
    assert (await store.preflight(p, entry("miss"))).outcome is Outcome.MISS
    await store.fill(p, {}, [], policy_ttl=60)  # no policy: allowed, so an entry too
    assert (await store.preflight(p, entry("nopolicy"))).outcome is Outcome.ALLOW
    await store.evict_policy(p.policy_key)
    await store.fill(p, fields({KEY_DAY: 100}), [], policy_ttl=60)
    pf = await store.preflight(p, entry("usage-miss"))  # the policy's usage key is absent
    assert pf.outcome is Outcome.MISS
    await warm(harness, p, {KEY_DAY: 100}, settled=99)
    assert (await store.preflight(p, entry("allowed", "x"))).outcome is Outcome.ALLOW
    await store.postflight("r1", 1, [usage_key(p, KEY_DAY)])
    assert (await store.preflight(p, entry("denied"))).outcome is Outcome.DENY
    assert await store.open_entries(ENTRIES) == {"nopolicy": "v", "allowed": "x"}


@pytest.mark.parametrize("big", [2**53 - 7, 2**53 + 1, 9 * 10**17 - 1])
async def test_the_entry_follows_the_exact_decision_near_2_pow_53(
    harness: Harness, big: int
) -> None:
    """The script decides whether to write the entry on its own; it must agree with the
    caller's exact integers even where a double can't tell the amounts apart."""
    p = keys_for(harness)
    bal = p.find(BALANCE)
    fill = UsageFill(bal.usage_key, big - 1, bal.expires_at, limit=big)
    await harness.store.fill(p, fields({BALANCE: 1}), [fill], policy_ttl=60)
    assert (await harness.store.preflight(p, entry("under"))).outcome is Outcome.ALLOW
    await harness.store.postflight("r1", 1, [bal.usage_key])  # used == topped up
    assert (await harness.store.preflight(p, entry("at"))).outcome is Outcome.DENY
    assert set(await harness.store.open_entries(ENTRIES)) == {"under"}


async def test_postflight_closes_the_entry_and_close_entries_removes_it(
    harness: Harness,
) -> None:
    p = keys_for(harness)
    store = harness.store
    await warm(harness, p, {KEY_DAY: 10**6})
    day = usage_key(p, KEY_DAY)
    for rid in ("a", "b", "c"):
        assert (await store.preflight(p, entry(rid, f"open-{rid}"))).outcome is Outcome.ALLOW
    assert await store.postflight("a", 5, [day], entry_key=ENTRIES, closed="rec-a") == 1
    assert await store.postflight("b", 0, [], entry_key=ENTRIES) == 0  # not charged: removed
    # An entry already gone (recovered or written) is not brought back by a late postflight.
    assert await store.postflight("gone", 5, [day], entry_key=ENTRIES, closed="rec") == 1
    assert await store.open_entries(ENTRIES) == {"a": "rec-a", "c": "open-c"}
    assert await store.read_usage([day]) == {day: 10}
    await store.close_entries({ENTRIES: ["a", "c", "never"]})
    assert await store.open_entries(ENTRIES) == {}


async def test_a_hard_limit_holds_each_admission_until_postflight(harness: Harness) -> None:
    p = keys_for(harness)
    store = harness.store
    day = usage_key(p, KEY_DAY)
    await store.fill(p, {"h:" + field_of(KEY_DAY): 100}, [], policy_ttl=60)
    await store.fill(p, None, [UsageFill(day, 0, p.find(KEY_DAY).expires_at)], policy_ttl=60)
    for rid in ("a", "b", "c"):
        pf = await store.preflight(p, record_id=rid, hold=30)
        assert pf.outcome is Outcome.ALLOW and pf.limits[0].hard
    assert await store.read_usage([day]) == {day: 90}  # the holds count as usage
    pf = await store.preflight(p, record_id="d", hold=30)  # 90 + 30 > 100
    assert pf.outcome is Outcome.DENY and pf.denied is not None and pf.denied.hard
    assert await store.postflight("a", 10, [day]) == 1  # hold 30 replaced by 10
    assert await store.postflight("b", None, [day]) == 0  # not charged: released only
    assert await store.read_usage([day]) == {day: 40}
    assert (await store.preflight(p, record_id="e", hold=60)).outcome is Outcome.ALLOW  # 100
    assert (await store.preflight(p, record_id="f", hold=1)).outcome is Outcome.DENY
    # Settlement of a record drops its hold too (a postflight that never came).
    await store.refresh([RefreshEntry(day, 10, ("a", "c", "e"))])
    assert await store.read_usage([day]) == {day: 10}
    assert not any((await store.pending_records([day])).values())  # no marker left


async def test_soft_and_hard_limits_on_one_request(harness: Harness) -> None:
    p = keys_for(harness)
    limits = {"h:" + field_of(KEY_DAY): 1_000, field_of(TEAM_MONTH): 50}
    fills = [UsageFill(c.usage_key, 0, c.expires_at) for c in p.checks if c.target in
             (KEY_DAY, TEAM_MONTH)]  # fmt: skip
    await harness.store.fill(p, limits, fills, policy_ttl=60)
    pf = await harness.store.preflight(p, record_id="a", hold=400)
    assert pf.outcome is Outcome.ALLOW
    by_target = {s.check.target: s for s in pf.limits}
    assert by_target[KEY_DAY].hard and not by_target[TEAM_MONTH].hard
    # The soft limit is not held; the hard one is.
    reads = await harness.store.read_usage([usage_key(p, KEY_DAY), usage_key(p, TEAM_MONTH)])
    assert reads == {usage_key(p, KEY_DAY): 400, usage_key(p, TEAM_MONTH): 0}
    await harness.store.postflight("a", 60, [usage_key(p, KEY_DAY), usage_key(p, TEAM_MONTH)])
    pf = await harness.store.preflight(p, record_id="b", hold=400)
    assert pf.outcome is Outcome.DENY and pf.denied is not None
    assert pf.denied.check.target == TEAM_MONTH  # the soft limit is reached (60 >= 50)


@pytest.mark.parametrize(
    ("model", "outcome"),
    [
        ("gpt-4o-mini", Outcome.ALLOW),  # on the key's list and the team's
        ("gpt-4o", Outcome.MODEL),  # the team's list, not the key's
        ("claude-3-x", Outcome.MODEL),  # the team's list, not the key's
        ("o1", Outcome.MODEL),  # neither
        ("a.b", Outcome.ALLOW),  # a glob's dot is a dot...
        ("axb", Outcome.MODEL),  # ...not any character
        ("50%(off)", Outcome.ALLOW),  # Lua's magic characters are literal
    ],
)
async def test_model_lists_admit_only_what_every_list_allows(
    harness: Harness, model: str, outcome: Outcome
) -> None:
    p = keys_for(harness)
    lists = {
        "allow:": "gpt-4o*\nclaude-?-x\na.b\n50%(off)",
        "allow:alpha": "gpt-4o-mini\nclaude-9-*\na.b\n5?%(*)",
    }
    await harness.store.fill(p, {**fields({KEY_DAY: 10**6}), **lists}, [], policy_ttl=60)
    await warm(harness, p, {KEY_DAY: 10**6})
    pf = await harness.store.preflight(p, entry("r", "v"), hold=5, model=model)
    assert pf.outcome is outcome
    # A refused model touches nothing: no hold, no entry.
    written = await harness.store.open_entries(ENTRIES)
    used = await harness.store.read_usage([usage_key(p, KEY_DAY)])
    assert (written == {}) == (outcome is Outcome.MODEL)
    assert used == {usage_key(p, KEY_DAY): 0}  # soft limit: no hold either way


async def test_a_team_list_applies_to_keys_without_one(harness: Harness) -> None:
    p = keys_for(harness, key="beta")
    await harness.store.fill(p, {"allow:": "gpt-*"}, [], policy_ttl=60)
    assert (await harness.store.preflight(p, model="gpt-x")).outcome is Outcome.ALLOW
    assert (await harness.store.preflight(p, model="claude")).outcome is Outcome.MODEL
    assert (await harness.store.preflight(p)).outcome is Outcome.ALLOW  # no model: not checked


async def test_read_parts_tells_settled_pending_and_held_apart(harness: Harness) -> None:
    p = keys_for(harness)
    day = usage_key(p, KEY_DAY)
    await harness.store.fill(p, {"h:" + field_of(KEY_DAY): 1_000}, [], policy_ttl=60)
    await harness.store.fill(
        p, None, [UsageFill(day, 7, p.find(KEY_DAY).expires_at)], policy_ttl=60
    )
    await harness.store.preflight(p, record_id="running", hold=100)
    await harness.store.preflight(p, record_id="done", hold=100)
    await harness.store.postflight("done", 20, [day])
    parts = await harness.store.read_parts([day, "quota:{acme}:absent"])
    assert parts[day] == CachedParts(settled=7, pending=20, held=100)
    assert parts["quota:{acme}:absent"] is None


# -- rates (design.md, "Rates") ------------------------------------------------------------
W = 60_000


def minute_start(h: Harness) -> int:
    """The start (epoch ms) of the next whole minute: the rates' time is the caller's."""
    return (int(h.now().timestamp() * 1000) // W + 1) * W


async def rated(
    h: Harness, p: KeyPlan, rates: dict[str | None, Rates], limits: dict[Target, int] | None = None
) -> None:
    policy: dict[str, int | str] = {**fields(limits or {})}
    policy.update({rate_field(k): r.encode() for k, r in rates.items()})
    await h.store.fill(p, policy, [], policy_ttl=60)
    if limits:
        await warm(h, p, limits)


async def admit(h: Harness, p: KeyPlan, rid: str, now_ms: int, tokens: int = 0, **kw: Any) -> Any:
    return await h.store.preflight(p, record_id=rid, now_ms=now_ms, tokens=tokens, **kw)


async def test_without_rates_nothing_is_counted(harness: Harness) -> None:
    p = keys_for(harness)
    await rated(harness, p, {}, {KEY_DAY: 10**6})
    pf = await admit(harness, p, "a", minute_start(harness), tokens=500)
    assert pf.outcome is Outcome.ALLOW and pf.rates == () and pf.rate_denied is None


async def test_rpm_slides_over_two_fixed_minutes(harness: Harness) -> None:
    p = keys_for(harness)
    await rated(harness, p, {ALPHA.api_key: Rates(rpm=3)})
    t = minute_start(harness)
    for i in range(3):
        pf = await admit(harness, p, f"a{i}", t + i)
        assert pf.outcome is Outcome.ALLOW
    assert pf.rates[0].requests == 3 and pf.rates[0].remaining(RateKind.RPM) == 0
    pf = await admit(harness, p, "a3", t + 59_999)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert (pf.rate_denied.kind, pf.rate_denied.state.scope) == (RateKind.RPM, SubjectKind.API_KEY)
    # The next minute opens with the previous one weighing fully: still 3 of 3...
    pf = await admit(harness, p, "b0", t + W)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert pf.rate_denied.retry_after() == 20  # 3 * (1 - 20/60) + 1 <= 3 from 20 s on
    # ...one millisecond early is still one too many; at 20 s exactly one fits, not two.
    assert (await admit(harness, p, "b1", t + W + 19_999)).outcome is Outcome.RATE
    assert (await admit(harness, p, "b2", t + W + 20_000)).outcome is Outcome.ALLOW
    assert (await admit(harness, p, "b3", t + W + 20_000)).outcome is Outcome.RATE
    # Two minutes on, nothing counts any more.
    for i in range(3):
        assert (await admit(harness, p, f"c{i}", t + 3 * W)).outcome is Outcome.ALLOW


async def test_tpm_reserves_at_admission_and_trues_up_at_completion(harness: Harness) -> None:
    p = keys_for(harness)
    await rated(harness, p, {ALPHA.api_key: Rates(tpm=1000)})
    rate_key = p.rate_keys[0]
    t = minute_start(harness)
    assert (await admit(harness, p, "a", t, tokens=400)).outcome is Outcome.ALLOW
    assert (await admit(harness, p, "b", t, tokens=400)).outcome is Outcome.ALLOW
    pf = await admit(harness, p, "c", t, tokens=400)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert (pf.rate_denied.kind, pf.rate_denied.cost) == (RateKind.TPM, 400)
    assert pf.rates[0].tokens == 800  # a denied request reserved nothing
    # "a" used 100 of its 400: 300 come back, and "c" fits.
    await harness.store.postflight("a", 1, [], rate_keys=[rate_key], tokens=100)
    pf = await admit(harness, p, "c", t + 1, tokens=400)
    assert pf.outcome is Outcome.ALLOW and pf.rates[0].tokens == 900
    # An uncharged inference gives its whole reservation back; a re-sent postflight nothing.
    await harness.store.postflight("b", None, [], rate_keys=[rate_key])
    await harness.store.postflight("b", None, [], rate_keys=[rate_key])
    pf = await admit(harness, p, "d", t + 2, tokens=0)
    assert pf.rates[0].tokens == 500
    # Using more than reserved counts in full, in the minute the reservation was made.
    await harness.store.postflight("c", 1, [], rate_keys=[rate_key], tokens=2000)
    pf = await admit(harness, p, "e", t + W, tokens=1)
    assert pf.outcome is Outcome.RATE and pf.rates[0].prev_tokens == 2100
    # A request larger than the rate itself never fits.
    pf = await admit(harness, p, "f", t + 10 * W, tokens=1001)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert pf.rate_denied.retry_after() is None


async def test_parallel_cap_frees_slots_at_completion_and_at_their_deadline(
    harness: Harness,
) -> None:
    p = keys_for(harness)
    await rated(harness, p, {ALPHA.api_key: Rates(max_parallel=2)})
    rate_key = p.rate_keys[0]
    t = minute_start(harness)
    ttl = {"slot_ttl_ms": 1000}
    assert (await admit(harness, p, "a", t, **ttl)).outcome is Outcome.ALLOW
    assert (await admit(harness, p, "b", t, **ttl)).outcome is Outcome.ALLOW
    pf = await admit(harness, p, "c", t + 1, **ttl)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert pf.rate_denied.kind is RateKind.PARALLEL and pf.rates[0].in_flight == 2
    await harness.store.postflight("a", 1, [], rate_keys=[rate_key], tokens=5)
    assert (await admit(harness, p, "c", t + 2, **ttl)).outcome is Outcome.ALLOW
    # "b" and "c" belong to a gateway that died: nobody finishes them. Until their deadline
    # they hold their slots; after it they are dropped.
    assert (await admit(harness, p, "d", t + 999, **ttl)).outcome is Outcome.RATE
    pf = await admit(harness, p, "d", t + 1002, **ttl)
    assert pf.outcome is Outcome.ALLOW and pf.rates[0].in_flight == 1
    # A late postflight of an expired slot frees nothing twice.
    await harness.store.postflight("b", 1, [], rate_keys=[rate_key], tokens=5)
    assert (await admit(harness, p, "e", t + 1003, **ttl)).outcome is Outcome.ALLOW
    assert (await admit(harness, p, "f", t + 1004, **ttl)).outcome is Outcome.RATE


async def test_an_admission_sent_again_holds_one_parallel_slot(harness: Harness) -> None:
    """A preflight sent again under the same record id (its first reply lost) keeps one
    in-flight entry, and its postflight frees it: a slot is never held twice by one request."""
    p = keys_for(harness)
    await rated(harness, p, {ALPHA.api_key: Rates(max_parallel=2)})
    rate_key = p.rate_keys[0]
    t = minute_start(harness)
    assert (await admit(harness, p, "a", t)).outcome is Outcome.ALLOW
    pf = await admit(harness, p, "a", t + 1)
    assert pf.outcome is Outcome.ALLOW and pf.rates[0].in_flight == 1
    pf = await admit(harness, p, "b", t + 2)
    assert pf.outcome is Outcome.ALLOW and pf.rates[0].in_flight == 2
    assert (await admit(harness, p, "c", t + 3)).outcome is Outcome.RATE
    await harness.store.postflight("a", 1, [], rate_keys=[rate_key], tokens=5)
    pf = await admit(harness, p, "c", t + 4)
    assert pf.outcome is Outcome.ALLOW and pf.rates[0].in_flight == 2


async def test_an_admission_sent_again_after_its_deadline_holds_a_slot_again(
    harness: Harness,
) -> None:
    """Its first entry lapsed (dropped at its deadline): sent again, it is in flight again."""
    p = keys_for(harness)
    await rated(harness, p, {ALPHA.api_key: Rates(max_parallel=1)})
    t = minute_start(harness)
    ttl = {"slot_ttl_ms": 1000}
    assert (await admit(harness, p, "a", t, **ttl)).outcome is Outcome.ALLOW
    pf = await admit(harness, p, "a", t + 1001, **ttl)
    assert pf.outcome is Outcome.ALLOW and pf.rates[0].in_flight == 1
    assert (await admit(harness, p, "b", t + 1002, **ttl)).outcome is Outcome.RATE


async def test_a_withdrawn_admission_is_uncounted_in_the_minute_it_was_counted(
    harness: Harness,
) -> None:
    """Another slot's check refused the request after the spend limits admitted it: its
    request count goes with its in-flight slot and its reservation, in the minute it was
    counted in (a later minute's count is another request's), never below 0."""
    p = keys_for(harness)
    await rated(harness, p, {ALPHA.api_key: Rates(rpm=2, tpm=1000)})
    rate_key = p.rate_keys[0]
    t = minute_start(harness)
    minute = t // W
    assert (await admit(harness, p, "a", t, tokens=300)).outcome is Outcome.ALLOW
    assert (await admit(harness, p, "b", t, tokens=300)).outcome is Outcome.ALLOW
    assert (await admit(harness, p, "c", t + 1, tokens=1)).outcome is Outcome.RATE
    await harness.store.postflight("b", None, [], rate_keys=[rate_key], withdrawn=minute)
    pf = await admit(harness, p, "c", t + 2, tokens=1)
    assert pf.outcome is Outcome.ALLOW  # "b" no longer counts
    assert (pf.rates[0].requests, pf.rates[0].tokens) == (2, 301)
    # Withdrawn a minute later, "c" comes off the previous minute's count.
    await harness.store.postflight("c", None, [], rate_keys=[rate_key], withdrawn=minute)
    pf = await admit(harness, p, "d", t + W, tokens=0)
    assert (pf.rates[0].prev_requests, pf.rates[0].requests) == (1, 1)
    # A withdrawal from a minute no longer counted changes nothing.
    await harness.store.postflight("d", None, [], rate_keys=[rate_key], withdrawn=minute - 5)
    pf = await admit(harness, p, "e", t + W + 1, tokens=0)
    assert pf.outcome is Outcome.RATE  # "a", and "d" still, in the rolling 2 a minute


async def test_key_rates_are_checked_before_the_team_rates(harness: Harness) -> None:
    alpha, beta = keys_for(harness), keys_for(harness, key="beta")
    await rated(harness, alpha, {None: Rates(rpm=3), "beta": Rates(rpm=1)})
    t = minute_start(harness)
    assert (await admit(harness, alpha, "a1", t)).outcome is Outcome.ALLOW
    pf = await admit(harness, alpha, "a2", t)
    assert pf.outcome is Outcome.ALLOW
    assert [s.scope for s in pf.rates] == [SubjectKind.TEAM]  # alpha has no rates of its own
    pf = await admit(harness, beta, "b1", t)
    assert pf.outcome is Outcome.ALLOW
    assert [(s.scope, s.requests) for s in pf.rates] == [
        (SubjectKind.API_KEY, 1),
        (SubjectKind.TEAM, 3),
    ]
    pf = await admit(harness, beta, "b2", t)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert pf.rate_denied.state.scope is SubjectKind.API_KEY  # the narrowest first
    pf = await admit(harness, alpha, "a3", t)
    assert pf.outcome is Outcome.RATE and pf.rate_denied is not None
    assert pf.rate_denied.state.scope is SubjectKind.TEAM


async def test_a_rate_denial_writes_nothing_and_a_spend_denial_counts_no_rate(
    harness: Harness,
) -> None:
    p = keys_for(harness)
    limits: dict[Target, int] = {TEAM_MONTH: 1000}
    policy = {**fields(limits), rate_field(ALPHA.api_key): Rates(rpm=1).encode()}
    policy["h:" + field_of(TEAM_MONTH)] = policy.pop(field_of(TEAM_MONTH))
    month = usage_key(p, TEAM_MONTH)
    await harness.store.fill(
        p, policy, [UsageFill(month, 0, p.find(TEAM_MONTH).expires_at)], policy_ttl=60
    )
    t = minute_start(harness)
    assert (await admit(harness, p, "a", t, hold=100, entry=entry("a", "v"))).outcome is (
        Outcome.ALLOW
    )
    pf = await admit(harness, p, "b", t, hold=100, entry=entry("b", "v"))
    assert pf.outcome is Outcome.RATE
    assert set(await harness.store.open_entries(ENTRIES)) == {"a"}  # no entry for "b"
    parts = await harness.store.read_parts([usage_key(p, TEAM_MONTH)])
    assert parts[usage_key(p, TEAM_MONTH)] == CachedParts(0, 0, 100)  # "a"'s hold only
    # A spend limit that denies decides first, and no rate counts the request.
    pf = await admit(harness, p, "c", t + 2 * W, hold=2000)
    assert pf.outcome is Outcome.DENY and pf.rates == ()
    assert (await admit(harness, p, "d", t + 2 * W, hold=1)).outcome is Outcome.ALLOW


@pytest.mark.parametrize("rates", [Rates(rpm=5), Rates(tpm=50), Rates(max_parallel=5)])
async def test_concurrent_callers_get_exactly_the_rate(harness: Harness, rates: Rates) -> None:
    p = keys_for(harness)
    await rated(harness, p, {None: rates})
    t = minute_start(harness)
    outcomes: list[Outcome] = []

    async def one(i: int) -> None:
        outcomes.append((await admit(harness, p, f"r{i}", t, tokens=10)).outcome)

    async with anyio.create_task_group() as tg:
        for i in range(100):
            tg.start_soon(one, i)
    assert outcomes.count(Outcome.ALLOW) == 5
    assert outcomes.count(Outcome.RATE) == 95
