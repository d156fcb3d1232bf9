"""Threshold alerts fired by the postflight step, on every store of the contract harness."""

from __future__ import annotations

import anyio
import pytest

from spendguard.alerts import marks_for, parse_pending
from spendguard.limits import KeyCodec, Policy
from spendguard.store import AlertMarks, EntryWrite, Outcome, RefreshEntry, UsageFill
from tests.store.conftest import Harness
from tests.store.test_contract import (
    ALPHA,
    BALANCE,
    GRACE,
    KEY_DAY,
    KEY_MONTH,
    TEAM_MONTH,
    fields,
    keys_for,
    usage_key,
    warm,
)

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]

ALERTS = KeyCodec("quota", GRACE).alerts_key("acme")


async def charge(h: Harness, rid: str, amount: int, thresholds: tuple[int, ...] = (50, 80, 100)):
    """One allowed request's postflight, as the guard asks for it."""
    p = keys_for(h)
    pf = await h.store.preflight(p)
    assert pf.outcome is Outcome.ALLOW
    marks = marks_for(ALERTS, pf.limits, thresholds)
    assert marks is not None
    await h.store.postflight(rid, amount, [s.check.usage_key for s in pf.limits], alerts=marks)
    return marks.fired


async def fired(h: Harness) -> dict[tuple[str | None, str, int, int], int]:
    """(api key, window, percent, limit) -> usage when it fired."""
    out = {}
    for name, value in (await h.store.pending_alerts(ALERTS)).items():
        alert = parse_pending("acme", name, value)
        assert alert is not None, name
        out[(alert.api_key, alert.window, alert.percent, alert.limit_micros)] = alert.used_micros
    return out


async def test_each_threshold_fires_once_when_usage_reaches_it(harness: Harness) -> None:
    await warm(harness, keys_for(harness), {KEY_DAY: 1000, TEAM_MONTH: 2200})
    assert await charge(harness, "r1", 499) == 0
    assert await fired(harness) == {}
    assert await charge(harness, "r2", 1) == 1  # 500 = 50 % of the key's day
    assert await charge(harness, "r3", 1) == 0  # past it: not again
    # 1,101: the key's 80 % and 100 % in one step, and its team's month 50 %
    assert await charge(harness, "r4", 600) == 3
    assert await fired(harness) == {
        ("alpha", "day", 50, 1000): 500,
        ("alpha", "day", 80, 1000): 1101,
        ("alpha", "day", 100, 1000): 1101,
        (None, "month", 50, 2200): 1101,
    }


async def test_a_new_limit_amount_alerts_again(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 1000})
    assert await charge(harness, "r1", 900, (80,)) == 1
    await harness.store.evict_policy(p.policy_key)
    await warm(harness, p, {KEY_DAY: 1100})  # raised: 900 is 81 % of it
    assert await charge(harness, "r2", 1, (80,)) == 1
    assert set(await fired(harness)) == {("alpha", "day", 80, 1000), ("alpha", "day", 80, 1100)}


async def test_dropped_alerts_are_gone_and_do_not_fire_again(harness: Harness) -> None:
    await warm(harness, keys_for(harness), {KEY_DAY: 100})
    assert await charge(harness, "r1", 50, (50,)) == 1
    pending = await harness.store.pending_alerts(ALERTS)
    await harness.store.drop_alerts(ALERTS, list(pending))
    assert await harness.store.pending_alerts(ALERTS) == {}
    assert await charge(harness, "r2", 10, (50,)) == 0


async def test_concurrent_postflights_fire_each_threshold_once(harness: Harness) -> None:
    await warm(harness, keys_for(harness), {KEY_DAY: 4000})
    counts: list[int] = []

    async def one(i: int) -> None:
        counts.append(await charge(harness, f"r{i}", 20, (25, 40, 50)))

    async with anyio.create_task_group() as tg:
        for i in range(100):  # 2,000 in all: every threshold is crossed by someone
            tg.start_soon(one, i)
    assert sum(counts) == 3
    assert {k[2] for k in await fired(harness)} == {25, 40, 50}


async def test_alerts_ride_with_the_entry_and_rates_in_one_call(harness: Harness) -> None:
    p = keys_for(harness)
    await warm(harness, p, {KEY_DAY: 100})
    entries = KeyCodec("quota", GRACE).entries_key("acme")
    pf = await harness.store.preflight(p, EntryWrite(entries, "r1", "open"))
    assert pf.outcome is Outcome.ALLOW
    day = usage_key(p, KEY_DAY)
    marks = AlertMarks(ALERTS, [(100, ((50, 50),))])
    assert (
        await harness.store.postflight(
            "r1", 60, [day], entry_key=entries, closed="done", alerts=marks
        )
        == 1
    )
    assert marks.fired == 1
    assert await harness.store.open_entries(entries) == {"r1": "done"}
    assert await harness.store.read_usage([day]) == {day: 60}
    # Without an entry: the same call, the entry left alone.
    marks = AlertMarks(ALERTS, [(100, ((60, 60),))])
    assert await harness.store.postflight("r2", 1, [day], alerts=marks) == 1
    assert marks.fired == 1 and await harness.store.open_entries(entries) == {"r1": "done"}


async def test_no_alert_for_a_missing_usage_key(harness: Harness) -> None:
    p = keys_for(harness)
    marks = AlertMarks(ALERTS, [(10, ((50, 5),))])
    assert await harness.store.postflight("r1", 10, [usage_key(p, KEY_DAY)], alerts=marks) == 0
    assert marks.fired == 0 and await harness.store.pending_alerts(ALERTS) == {}
    assert ALPHA.team == "acme"


async def test_a_limit_with_thresholds_of_its_own_alerts_at_those(harness: Harness) -> None:
    """A policy's own thresholds ride in its policy hash and come back with the preflight
    that reads the limit: its own replace the default, ``()`` silences it, None keeps it."""
    p = keys_for(harness)
    policies = [
        Policy(KEY_DAY, 1000, "acme", "alpha", alert_at=(30, 90)),
        Policy(TEAM_MONTH, 2000, "acme", alert_at=()),
        Policy(KEY_MONTH, 4000, "acme", "alpha"),
    ]
    wanted = {KEY_DAY, TEAM_MONTH, KEY_MONTH}
    fills = [UsageFill(c.usage_key, 0, c.expires_at) for c in p.checks if c.target in wanted]
    await harness.store.fill(
        p, KeyCodec.policy_fields(policies, balance=False), fills, policy_ttl=60
    )
    pf = await harness.store.preflight(p)
    assert {s.check.target: s.alert_at for s in pf.limits} == {
        KEY_DAY: "30,90",
        TEAM_MONTH: "",
        KEY_MONTH: None,
    }
    assert await charge(harness, "r1", 600, (50,)) == 1  # the key's day 30 %; not 50 % of it
    assert await charge(harness, "r2", 1500, (50,)) == 2  # its day's 90 %, its month's 50 %
    assert await fired(harness) == {
        ("alpha", "day", 30, 1000): 600,
        ("alpha", "day", 90, 1000): 2100,
        ("alpha", "month", 50, 4000): 2100,
    }  # and nothing of the team's month (2,100 is past 100 % of it: silenced)


async def test_a_balance_alerts_at_shares_of_what_was_topped_up(harness: Harness) -> None:
    """A prepaid balance's thresholds are shares of its topped-up total used; a top-up is a new
    amount, so they fire again from it."""
    p = keys_for(harness)
    bal = p.find(BALANCE)
    fill = UsageFill(bal.usage_key, 0, bal.expires_at, limit=1000)
    await harness.store.fill(p, fields({BALANCE: 1}), [fill], policy_ttl=60)
    assert await charge(harness, "r1", 799, (80,)) == 0
    assert await charge(harness, "r2", 1, (80,)) == 1
    assert await charge(harness, "r3", 100, (80,)) == 0  # once
    await harness.store.refresh([RefreshEntry(bal.usage_key, 900, ("r1", "r2", "r3"), limit=1100)])
    assert await charge(harness, "r4", 1, (80,)) == 1  # 901 of 1,100: 80 % of the new amount
    assert await fired(harness) == {
        (None, "balance", 80, 1000): 800,
        (None, "balance", 80, 1100): 901,
    }
    pending = await harness.store.pending_alerts(ALERTS)
    alerts = [parse_pending("acme", name, value) for name, value in pending.items()]
    assert {a.resets_at for a in alerts if a is not None} == {None}
