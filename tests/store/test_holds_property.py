"""Holds never leak (property): random admissions against a hard limit, completions, client
cancellations, upstream errors and gateway deaths, in any interleaving. While it runs the limit
is never overrun; once every hold has finished (or its dead gateway's record has settled) the
counter equals the sum of the costs actually charged.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spendguard.identity import Identity
from spendguard.limits import KeyCodec, Period, key_limit
from spendguard.limits.codec import field_of
from spendguard.store import Outcome, RefreshEntry, UsageFill
from spendguard.store.memory import MemoryStore

ALPHA = Identity("acme", "alpha")
KEY_DAY = key_limit(ALPHA, Period.DAY)
LIMIT = 1_000

# (kind, hold or cost): admit a request holding `n`; finish the oldest running one, charged
# `n` (at most its hold) or cancelled (charged what was served) or failed upstream (nothing);
# the gateway of the oldest running one dies (recovery charges its hold, settlement follows).
ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 400)),
        st.tuples(st.sampled_from(["done", "cancel", "error", "death"]), st.integers(0, 400)),
        st.tuples(st.just("settle"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
@pytest.mark.anyio
async def test_holds_never_leak_and_never_overrun(script: list[tuple[str, int]]) -> None:
    now = datetime(2026, 9, 30, 12, tzinfo=UTC)
    store = MemoryStore(clock=lambda: now)
    plan = KeyCodec("quota", timedelta(days=2)).plan(ALPHA, now)
    key = plan.find(KEY_DAY).usage_key
    await store.fill(plan, {"h:" + field_of(KEY_DAY): LIMIT}, [], policy_ttl=600)
    await store.fill(plan, None, [UsageFill(key, 0, now + timedelta(days=2))], policy_ttl=600)
    running: list[tuple[str, int]] = []  # (record id, hold)
    charged: dict[str, int] = {}  # record id -> what it costs (unsettled or settled)
    settled: set[str] = set()
    for n, (kind, amount) in enumerate(script):
        if kind == "admit":
            rid = f"r{n}"
            pf = await store.preflight(plan, record_id=rid, hold=amount)
            held = sum(h for _, h in running)
            fits = sum(charged.values()) + held + amount <= LIMIT
            assert (pf.outcome is Outcome.ALLOW) == fits  # admitted exactly when it fits
            if fits:
                running.append((rid, amount))
        elif kind == "settle":
            # Settlement: the ledger's aggregate is everything charged; the settled records'
            # markers (and any hold of theirs) leave the cache.
            new = [rid for rid in charged if rid not in settled]
            await store.refresh([RefreshEntry(key, sum(charged.values()), tuple(new))])
            settled.update(new)
        elif running:
            rid, hold = running.pop(0)
            if kind == "error":
                await store.postflight(rid, None, [key])  # released, nothing charged
            elif kind == "death":
                charged[rid] = hold  # recovery charges the worst case; the hold stays...
                # ...until that record settles (the next "settle" step, or the end).
            else:  # done / cancel: charged what was used, never more than held
                cost = min(amount, hold)
                await store.postflight(rid, cost, [key])
                charged[rid] = cost
        used = (await store.read_usage([key]))[key]
        assert used is not None and used <= LIMIT  # the hard limit is never overrun
    for rid, _ in running:  # the rest finish without a charge
        await store.postflight(rid, None, [key])
    new = [rid for rid in charged if rid not in settled]
    await store.refresh([RefreshEntry(key, sum(charged.values()), tuple(new))])
    assert (await store.read_usage([key]))[key] == sum(charged.values())
