"""Admission entries on Redis: written when a request is allowed, gone once its record is in the
ledger, and written as records by a settling worker when their gateway died."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sqlalchemy as sa

from spendguard import Identity, Settings, SpendGuard
from spendguard.clock import to_micros, to_millis
from spendguard.engine.costing import Coster
from spendguard.engine.decision import InferenceRequest
from spendguard.engine.entries import (
    RECOVERED_OUTPUT_TOKENS,
    RECOVERED_STATUS,
    admission_usage,
    closed_entry,
    open_entry,
    recovered_record,
)
from spendguard.engine.pricing import Price, PriceTable
from spendguard.engine.recovery import Recovery
from spendguard.engine.worker import SettlementWorker
from spendguard.errors import LedgerUnavailable
from spendguard.ledger import Ledger
from spendguard.ledger.schema import charges, records
from spendguard.limits import KeyCodec
from spendguard.limits.model import BudgetLimit, SubjectKind
from spendguard.limits.rates import Rates, rate_field
from spendguard.limits.windows import Rolling
from spendguard.record import PostflightStatus
from spendguard.settings import UnknownModel
from spendguard.store import Outcome
from spendguard.store.redis import RedisStore
from spendguard.store.rolling import Bucket, BucketCheck, WindowCheck
from spendguard.usage import Dialect
from tests.support.records import make_record
from tests.support.sql import sql_rows

pytestmark = pytest.mark.anyio

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
T0_US = to_micros(T0)
ALPHA = Identity("acme", "alpha")
CODEC = KeyCodec("quota", timedelta(days=2))
ENTRIES = CODEC.entries_key(ALPHA.team)
ROUTE = "/v1/chat/completions"


@pytest.fixture(params=["redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
    else:  # the owners, their team lists and each team's entries live in different slots
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        url = cluster.url
    s = RedisStore.from_url(url, timeout=2.0)
    try:
        yield s
    finally:
        await s.aclose()


def coster() -> Coster:
    return Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)


async def leave(store: RedisStore, owner: str, entries: dict[str, str], *, alive: bool) -> None:
    """What a gateway leaves behind: its entries, its team list, and (alive) its heartbeat."""
    await store.add_member(CODEC.owners_key(), owner)
    await store.add_member(CODEC.owner_teams_key(owner), ALPHA.team)
    if alive:
        await store.heartbeat(CODEC.owners_key(), CODEC.owner_alive_key(owner), owner, 60_000)
    for rid, value in entries.items():
        await store._client.hset(ENTRIES, rid, value)  # type: ignore[misc]


async def written(url: str) -> dict[str, dict[str, Any]]:
    """The ledger's records by id, read on a connection of the test's own."""
    names = [c.name for c in records.columns]
    rows = await sql_rows(url, sa.select(records))
    return {row[0]: dict(zip(names, row, strict=True)) for row in rows}


def request(max_tokens: int | None = 40) -> InferenceRequest:
    return InferenceRequest("gpt-4o-mini", True, max_tokens, estimated_input_tokens=12)


async def test_a_dead_gateways_entries_become_records_once(
    ledger: Ledger, database_url: str, store: RedisStore
) -> None:
    finished = make_record("done1", T0, 25)
    await leave(
        store,
        "dead",
        {
            "done1": closed_entry("dead", finished, T0_US),
            "cut1": open_entry("dead", ALPHA, T0_US, "inf-1", request(), ROUTE),
            "cut2": open_entry("dead", ALPHA, T0_US, "inf-2", request(None), ROUTE),
        },
        alive=False,
    )
    recovery = Recovery(ledger, store, store, CODEC, coster(), me="me")
    assert await recovery.run_once() == 3
    rows = await written(database_url)
    assert set(rows) == {"done1", "cut1", "cut2"}
    done = rows["done1"]  # the finished inference: exactly its record
    assert (done["input_tokens"], done["estimate_micros"], done["status_code"]) == (25, 25, 200)
    assert done["postflight"] == PostflightStatus.APPLIED
    for rid, cap in (("cut1", 40), ("cut2", RECOVERED_OUTPUT_TOKENS)):
        cut = rows[rid]  # a cut stream: what admission allowed it, priced at the table
        usage = admission_usage(request(cap if rid == "cut1" else None))
        assert (cut["input_tokens"], cut["output_tokens"]) == (12, cap)
        assert cut["estimate_micros"] == coster().cost("gpt-4o-mini", usage) > 0
        assert cut["status_code"] == RECOVERED_STATUS and cut["usage_estimated"]
        assert cut["inference_id"] == ("inf-1" if rid == "cut1" else "inf-2")
    assert await store.open_entries(ENTRIES) == {}
    assert await store.members(CODEC.owners_key()) == []
    assert await recovery.run_once() == 0  # nothing twice
    assert len(await written(database_url)) == 3


async def test_a_dead_gateways_requests_leave_the_parallel_cap(
    ledger: Ledger, database_url: str, store: RedisStore
) -> None:
    now = datetime.now(UTC)
    plan = CODEC.plan(ALPHA, now)
    await store.fill(plan, {rate_field(ALPHA.api_key): Rates(max_parallel=1).encode()}, [],
                     policy_ttl=60)  # fmt: skip
    now_ms = to_millis(now)
    assert (await store.preflight(plan, record_id="cut1", now_ms=now_ms)).outcome is Outcome.ALLOW
    assert (await store.preflight(plan, record_id="x", now_ms=now_ms)).outcome is Outcome.RATE
    value = open_entry("dead", ALPHA, T0_US, "inf-1", request(), ROUTE)
    await leave(store, "dead", {"cut1": value}, alive=False)
    assert await Recovery(ledger, store, store, CODEC, coster(), me="me").run_once() == 1
    # Its slot is free at once, long before its deadline.
    assert (await store.preflight(plan, record_id="y", now_ms=now_ms)).outcome is Outcome.ALLOW


async def test_a_live_gateways_entries_are_left_alone(
    ledger: Ledger, database_url: str, store: RedisStore
) -> None:
    value = open_entry("live", ALPHA, T0_US, "inf", request(), ROUTE)
    await leave(store, "live", {"running": value}, alive=True)
    await leave(store, "dead", {"other": open_entry("dead", ALPHA, T0_US, "i", request(), ROUTE)},
                alive=False)  # fmt: skip
    assert await Recovery(ledger, store, store, CODEC, coster(), me="me").run_once() == 1
    assert await store.open_entries(ENTRIES) == {"running": value}
    assert list(await written(database_url)) == ["other"]


async def test_entries_wait_while_the_database_is_down(
    ledger: Ledger, database_url: str, store: RedisStore
) -> None:
    value = closed_entry("dead", make_record("r1", T0, 7), T0_US)
    await leave(store, "dead", {"r1": value}, alive=False)
    down = Ledger("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(LedgerUnavailable):
        await Recovery(down, store, store, CODEC, coster(), me="me").run_once()
    assert await store.open_entries(ENTRIES) == {"r1": value}  # kept for the next pass
    assert await Recovery(ledger, store, store, CODEC, coster(), me="me").run_once() == 1
    assert list(await written(database_url)) == ["r1"]


async def test_an_entry_the_database_refuses_is_dropped_not_blocking(
    ledger: Ledger, database_url: str, store: RedisStore
) -> None:
    poison = make_record("poison", T0, 2**63)  # one past BIGINT's range, on both databases
    await leave(
        store,
        "dead",
        {
            "poison": closed_entry("dead", poison, T0_US),
            "good": closed_entry("dead", make_record("good", T0, 3), T0_US),
            "junk": "not an entry",
        },
        alive=False,
    )
    await store._client.hset(ENTRIES, "junk", '[2,"dead"]')  # type: ignore[misc]
    assert await Recovery(ledger, store, store, CODEC, coster(), me="me").run_once() == 1
    assert list(await written(database_url)) == ["good"]
    assert await store.open_entries(ENTRIES) == {}


async def test_a_running_guard_keeps_an_entry_until_the_ledger_has_the_record(
    sqlite_url: str, redis_url: str
) -> None:
    settings = Settings(database_url=sqlite_url, redis_url=redis_url, run_worker=False)
    store = RedisStore.from_url(redis_url, timeout=2.0)
    guard = SpendGuard(settings, store=store)
    await guard.start(worker=False)
    try:
        served = await guard.admit(ALPHA, request(), route=ROUTE, dialect=Dialect.OPENAI)
        failed = await guard.admit(ALPHA, request(), route=ROUTE, dialect=Dialect.OPENAI)
        assert served.decision is not None and failed.decision is not None
        open_ = await store.open_entries(ENTRIES)
        assert set(open_) == {served.decision.record_id, failed.decision.record_id}
        assert all(v.startswith("[1,") for v in open_.values())
        await guard.finish(failed, 502, None)  # not charged: the entry goes at once
        await guard.finish(served, 200, None)
        held = await store.open_entries(ENTRIES)
        assert (
            list(held) == [served.decision.record_id] and held[served.decision.record_id][1] == "2"
        )
        await guard.recorder.flush()  # the ledger has it: the entry goes
        assert await store.open_entries(ENTRIES) == {}
        assert await store.members(CODEC.owner_teams_key(guard.owner)) == [ALPHA.team]
        assert await store.exists(CODEC.owner_alive_key(guard.owner))
    finally:
        await guard.stop()
    assert not await store.exists(CODEC.owner_alive_key(guard.owner))  # a clean stop says so
    await store.aclose()


async def test_a_guard_without_a_heartbeat_writes_no_entry(sqlite_url: str, redis_url: str) -> None:
    """Nobody would know such a process to be alive: its entries would be recovered while
    it runs, so it leaves none (its records are written through instead)."""
    settings = Settings(database_url=sqlite_url, redis_url=redis_url)
    store = RedisStore.from_url(redis_url, timeout=2.0)
    guard = SpendGuard(settings, store=store)  # never started
    try:
        admission = await guard.admit(ALPHA, request(), route=ROUTE, dialect=Dialect.OPENAI)
        assert admission.allowed and await store.open_entries(ENTRIES) == {}
        await guard.finish(admission, 200, None)
        assert await store.open_entries(ENTRIES) == {}
    finally:
        await guard.stop()
        await store.aclose()
    await anyio.lowlevel.checkpoint()


def test_an_entry_round_trips_any_text_exactly() -> None:
    """Entries are JSON built by hand: quotes, backslashes, control and non-ASCII characters
    in ids and model names come back exactly."""
    odd = Identity('a"b\\c\n\u2028é', None)
    req = InferenceRequest('m"\x00\u00e9', True, 7, estimated_input_tokens=3, size=41)
    value = open_entry("o", odd, T0_US, "inf\t1", req, "/r")
    record = recovered_record("rid", value, 99)
    assert (record.identity, record.model, record.inference_id) == (odd, req.model, "inf\t1")
    assert (record.usage.input_tokens, record.usage.output_tokens) == (11, 7)  # 41 bytes
    assert record.t0 == T0 and record.estimate_micros == 99
    again = recovered_record("rid", closed_entry("o", record, T0_US), 0)
    assert again == record
    priced = dataclasses.replace(record, price="0.15,0.6,0.075,0.15|200000:0.3,1.2,0.15,0.3")
    assert recovered_record("rid", closed_entry("o", priced, T0_US), 0) == priced


async def test_recovered_records_carry_the_price_they_were_charged_at(
    ledger: Ledger, database_url: str, store: RedisStore
) -> None:
    # The dead gateway's price for "m" (make_record's model) was one micro-USD per token; the
    # recovering process prices gpt-4o-mini at its own table, and a third settles all of it.
    recovering = PriceTable({"gpt-4o-mini": Price.of("0.3", "0.9")}, as_of="2026-11-01")
    settling = PriceTable(
        {"gpt-4o-mini": Price.of("5", "5"), "m": Price.of("2", "3")}, as_of="2026-11-01"
    )
    closed = closed_entry("dead", make_record("done", T0, 25), T0_US)
    # A closed entry of an earlier release: the same record, without the price.
    legacy = closed_entry("dead", make_record("legacy", T0, 25, price=None), T0_US)
    assert legacy.endswith(",null]")
    legacy = legacy.removesuffix(",null]") + "]"
    cut = open_entry("dead", ALPHA, T0_US, "inf-1", request(), ROUTE)
    await leave(store, "dead", {"done": closed, "legacy": legacy, "cut": cut}, alive=False)
    recovery = Recovery(ledger, store, store, CODEC, Coster(recovering, UnknownModel.FREE), me="me")
    assert await recovery.run_once() == 3
    rows = await written(database_url)
    assert rows["done"]["price"] == "1,1,1,1"  # as the gateway charged it
    assert rows["legacy"]["price"] is None  # unknown: the settling table prices it
    assert rows["cut"]["price"] == "0.3,0.9,0.3,0.3"  # the price recovery estimated it at
    # 12 tokens in at 0.3 and 40 out at 0.9 per million tokens of each: 39.6, rounded up.
    assert rows["cut"]["estimate_micros"] == 40
    coster_of_settler = Coster(settling, UnknownModel.FREE)
    assert (await SettlementWorker(ledger, None, coster_of_settler, CODEC).run_once()).settled == 3
    charged = await sql_rows(database_url, sa.select(charges.c.record_id, charges.c.amount_micros))
    assert dict(charged) == {"done": 25, "legacy": 25 * 2, "cut": 40}


async def test_a_dead_gateways_budget_alerts_reach_the_outbox(
    ledger: Ledger, store: RedisStore
) -> None:
    """Which buckets a dead gateway's budget alerts wait in died with it: recovery moves every
    bucket's."""
    bucket = Bucket(SubjectKind.API_KEY, f"acme:{uuid.uuid4().hex[:12]}")
    window = Rolling("hourly", "1h", 3600)
    call = BucketCheck(bucket, (WindowCheck(window, BudgetLimit(tokens=100, alert_at=(50,))),))
    now_ms = T0_US // 1000
    assert await store.commit_buckets(
        [call], "h1", now_ms=now_ms, at_ms=now_ms, tokens=60, cost=0, ttl_ms=7_200_000
    ) == [1]
    await leave(store, "dead", {}, alive=False)
    await Recovery(ledger, store, store, CODEC, coster(), me="me").run_once()
    assert await store.pending_alerts(store.bucket_alerts_key(bucket)) == {}
    [alert] = [a for a, _, _ in await ledger.recent_alerts() if a.api_key == bucket.subject[5:]]
    assert (alert.scope, alert.window, alert.percent, alert.used_micros) == (
        "budget",
        "hourly",
        50,
        60,
    )
