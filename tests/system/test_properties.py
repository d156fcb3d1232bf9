"""Property tests: random interleavings of traffic, settlement, crashes and policy changes.

After quiescence every aggregate equals the sum of the charges it should contain, no charge
is counted twice, every cached value equals its aggregate and every balance equals top-ups
minus charges. Embedded store and a real SQLite ledger; fixed clock inside one period.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spendguard import Identity, Settings, SpendGuard, Verdict
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger.schema import charges, records
from spendguard.limits import Balance, Limit, Period, Policy, Subject
from spendguard.store.memory import MemoryStore
from spendguard.usage import Usage
from tests.support import Clock, Override, sql_value, topups_total, write_unit_prices

TEAMS = ["acme", "beta"]
KEYS = ["k1", "k2"]
T0 = datetime(2026, 11, 10, 12, tzinfo=UTC)

spend = st.tuples(
    st.just("spend"), st.sampled_from(TEAMS), st.sampled_from(KEYS), st.integers(0, 50)
)
policy = st.tuples(
    st.just("policy"),
    st.sampled_from(TEAMS),
    st.sampled_from([None, *KEYS]),
    st.sampled_from([Period.DAY, Period.MONTH]),
    st.integers(0, 400),
)
remove = st.tuples(
    st.just("rm"),
    st.sampled_from(TEAMS),
    st.sampled_from([None, *KEYS]),
    st.sampled_from(list(Period)),
)
op = st.one_of(
    spend,
    spend,
    spend,
    policy,
    remove,
    st.just(("flush",)),
    st.just(("settle",)),
    st.just(("crash",)),
)


@pytest.mark.timeout(300)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(accounts=st.lists(st.sampled_from(TEAMS), unique=True), ops=st.lists(op, max_size=40))
def test_random_interleavings_keep_every_invariant(accounts: list[str], ops: list[Any]) -> None:
    tmp = Path(tempfile.mkdtemp())
    try:
        anyio.run(_scenario, tmp, accounts, ops)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _scenario(tmp: Path, accounts: list[str], ops: list[Any]) -> None:
    clock = Clock(T0)
    settings_ = Settings(database_url=f"sqlite:///{tmp / 'p.db'}", prices=write_unit_prices(tmp))
    store = MemoryStore(clock=clock)
    g = SpendGuard(settings_, store=store, clock=clock)
    await g.start(worker=False)
    led = g.ledger
    try:
        for team in accounts:
            await led.topup(team=team, team_id=team, micros=300)
        for step in ops:
            await _apply(g, store, step)
            clock.now += timedelta(seconds=1)
        # Quiescence: every record written, settled, and the cache refreshed.
        await g.recorder.flush()
        await g.worker.run_once()
        await g.worker.run_once()
        await _check(g, store, accounts)
    finally:
        await g.stop()


async def _apply(g: SpendGuard, store: MemoryStore, step: Any) -> None:
    kind = step[0]
    if kind == "spend":
        _, team, key, tokens = step
        decision = await g.preflight(Identity(team, key), g.clock())
        if decision.verdict is Verdict.ALLOW:
            await g.postflight(
                decision,
                model="unit-model",
                route="/v1/chat/completions",
                status_code=200,
                usage=Usage(input_tokens=tokens),
            )
    elif kind == "policy":
        _, team, key, period, limit = step
        limit_of = Limit(Subject(team, key), period)
        await g.ledger.set_policy(Policy(limit_of, limit, team, key), now=g.clock())
    elif kind == "rm":
        _, team, key, period = step
        await g.ledger.remove_policy(Limit(Subject(team, key), period))
    elif kind == "flush":
        await g.recorder.flush()
    elif kind == "settle":
        await g.worker.run_once()
    elif kind == "crash":  # a worker process dies between the DB commit and the refresh

        async def lost(entries: Any) -> None:
            raise RuntimeError("crashed between commit and refresh")

        crashing = SettlementWorker(
            g.ledger, Override(store, refresh=lost), g.coster, g.codec, clock=g.clock
        )
        with contextlib.suppress(RuntimeError):
            await crashing.run_once()


async def _check(g: SpendGuard, store: MemoryStore, accounts: list[str]) -> None:
    url = g.ledger.url

    async def value(query: Any) -> Any:
        return await sql_value(url, query)

    n_records = await value(sa.select(sa.func.count()).select_from(records))
    n_charges = await value(sa.select(sa.func.count()).select_from(charges))
    assert n_records == n_charges  # every record charged exactly once
    usage_sum = await value(sa.select(sa.func.coalesce(sa.func.sum(records.c.input_tokens), 0)))
    assert await g.ledger.charges_total() == usage_sum  # nothing counted twice or lost
    for team in TEAMS:
        agg = await g.ledger.policy_aggregates(g.clock(), [team])
        for a in agg.get(team, []):
            key = a.limit.subject.api_key
            column = charges.c.day_id if a.limit.window is Period.DAY else charges.c.month_id
            conds = [charges.c.team == team, column == a.bucket]
            if key is not None:
                conds.append(charges.c.api_key == key)
            expected = await value(
                sa.select(sa.func.coalesce(sa.func.sum(charges.c.amount_micros), 0)).where(*conds)
            )
            assert a.settled == expected, (team, a)  # the aggregate holds its charges, once
            usage_key = g.codec.usage_key(a.limit, a.bucket)
            cached = (await store.read_usage([usage_key]))[usage_key]
            assert cached in (None, a.settled), (team, a)  # cache == aggregate (or unloaded)
        account = await g.ledger.load_balance(team)
        if team in accounts:
            assert account is not None
            assert account.topped_up == await topups_total(url, team)
            charged = account.charged
            assert charged == await g.ledger.charges_total(team)  # top-ups minus charges
            key = g.codec.usage_key(Balance(team), "")
            assert (await store.read_usage([key]))[key] in (None, charged)
        else:
            assert account is None
