"""Holds stocked ahead in the shared buckets (the model's and the fleet's, engine/stock.py):
a warm request takes one instead of reserving there, and nothing a limit decides changes: every
request is counted once in every bucket, a burst admits exactly what the limit affords, a dead
gateway's request is recovered by its stocked hold, and what no request took goes back when
the gateway stops."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import pytest
from starlette.types import Receive, Scope, Send

from spendguard.engine.decision import InferenceRequest
from spendguard.engine.stock import Stock
from spendguard.identity import Identity, encode_id
from spendguard.limits.model import SubjectKind
from spendguard.store.rolling import Bucket
from tests.support import MODEL, Clock
from tests.support.budgets import BudgetGateway, section
from tests.support.gateway import chat_body, upstream
from tests.support.records import make_record

pytestmark = pytest.mark.anyio

EST = 100  # max_tokens=98 + the 2-token prompt: what a request reserves
FLEET = Bucket(SubjectKind.FLEET, "")


@pytest.fixture(params=["redis", "cluster"])
def shared(request: pytest.FixtureRequest) -> dict[str, object]:
    """Stock lives on a shared store only: Redis, one server or a Cluster."""
    url: str = (
        request.getfixturevalue("redis_url")
        if request.param == "redis"
        else request.getfixturevalue("redis_cluster").url
    )
    return {"redis_url": url, "key_prefix": f"s{uuid.uuid4().hex[:8]}", "redis_timeout": 2.0}


IDENTITY = Identity("acme", "alpha")  # StateAuth's


def scopes(tokens: int) -> dict[str, object]:
    """The key's, the model's and the fleet's budgets, the fleet's of ``tokens`` (the others
    far above: with two buckets at their limit at once, a burst's requests can each be
    refused by a different one, stock or not)."""
    return {
        "per_api_key": {"tokens": 10**9},
        "per_model": {MODEL: {"tokens": 10**9}},
        "global": {"tokens": tokens},
    }


def stock_of(gw: BudgetGateway) -> Stock:
    assert gw.gate.stock is not None
    return gw.gate.stock


async def held_and_used(gw: BudgetGateway, bucket: Bucket) -> tuple[int, int]:
    [call] = [c for c in gw.gate.plan(gw.gate.config, IDENTITY, MODEL)[0] if c.bucket == bucket]
    usage = await gw.budgets.store.inspect_bucket(call, gw.gate._now_ms())
    return usage.held_tokens, usage.windows[0].tokens


async def test_every_request_counts_once_in_the_shared_buckets_and_stock_goes_back(
    tmp_path: Path, shared: dict[str, object]
) -> None:
    budgets = section(storage="redis", scopes=scopes(10**9))
    gw = BudgetGateway(tmp_path, budgets=budgets, budget_stock=8, **shared)
    model = Bucket(SubjectKind.MODEL, encode_id(MODEL))
    used = 0
    async with gw, gw.client() as c:
        for _ in range(20):
            r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))
            assert r.status_code == 200
            usage = r.json()["usage"]
            used += usage["prompt_tokens"] + usage["completion_tokens"]
        # The first request found its buckets lost (a new Redis: rebuilt from the ledger, no
        # stock granted before), the second reserved centrally and stocked eight; every later
        # one took a stocked hold.
        assert stock_of(gw).taken == 18
        for bucket in (model, FLEET):
            held, counted = await held_and_used(gw, bucket)
            # Counted: what each request used, once. Held: only the unused stock, of one
            # request's estimate each.
            assert counted == used
            assert held > 0 and held % EST == 0 and held <= 8 * EST
        await gw.guard.stop()  # the gateway stops: its unused stock goes back
        for bucket in (model, FLEET):
            assert await held_and_used(gw, bucket) == (0, used)


@pytest.mark.parametrize("stock", [0, 8, 64])
async def test_a_burst_admits_exactly_what_a_shared_limit_affords(
    tmp_path: Path, shared: dict[str, object], stock: int
) -> None:
    # 200 requests at once against a global and a model budget worth K of them, each admitted
    # one held in the app until every request has been admitted or refused: exactly K, with
    # stock as without (its holds are one request's estimate each; a refusal where unused
    # stock sits gives it back and asks again).
    k, n = 60, 200
    inner = upstream()
    release = anyio.Event()
    entered = 0

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal entered
        if scope["type"] == "http":
            entered += 1
            await release.wait()
        await inner(scope, receive, send)

    # Two warm requests first (the buckets rebuilt, then the stock), each using 15 tokens.
    budgets = section(storage="redis", scopes=scopes(k * EST + 2 * 15))
    gw = BudgetGateway(tmp_path, budgets=budgets, app=gated, budget_stock=stock, **shared)
    statuses: list[int] = []
    async with gw, gw.client() as c:
        release.set()
        for _ in range(2):
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))).is_success
        release, entered = anyio.Event(), 0

        async def one() -> None:
            r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))
            statuses.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
            with anyio.fail_after(30):
                while entered + len(statuses) < n:
                    await anyio.sleep(0.01)
            admitted_while_held = entered
            release.set()
        if stock:
            assert stock_of(gw).taken > 0
    assert admitted_while_held == k
    assert statuses.count(200) == k and statuses.count(429) == n - k


async def test_a_dead_gateways_request_on_a_stocked_hold_is_recovered_once(
    tmp_path: Path, shared: dict[str, object]
) -> None:
    budgets = section(storage="redis", scopes=scopes(10**9))
    gw = BudgetGateway(tmp_path, budgets=budgets, budget_stock=8, **shared)
    async with gw, gw.client() as c:
        for _ in range(2):  # the buckets rebuilt, then the stock
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))).is_success
        before = await held_and_used(gw, FLEET)
        # A request takes a stocked hold, and its gateway dies before it ends: its admission
        # entry names the stocked id, and recovery counts its charge there, once.
        request = InferenceRequest(MODEL, False, 98, estimated_input_tokens=2)
        taken, admitting = gw.gate.start(IDENTITY, request)
        admission = await admitting
        assert admission is not None and admission.allowed and admission.hold is not None
        assert stock_of(gw).taken == 1 and admission.hold.id == taken
        record = dataclasses.replace(make_record(taken, gw.clock(), 70), model=MODEL)
        await gw.gate.recover(record)
        await gw.gate.recover(record)
        held, counted = await held_and_used(gw, FLEET)
        assert counted == before[1] + 70
        assert held == before[0] - EST  # the stocked hold became the charge


async def test_stale_stock_is_never_taken_and_goes_back_with_the_next_refill(
    tmp_path: Path, shared: dict[str, object]
) -> None:
    # A stocked hold is taken only while fresh (a tenth of hold_seconds, at most 30 s), so a
    # request's hold lasts nearly as long as one reserved for it; older ones go back.
    clock = Clock(datetime.now(UTC))
    budgets = section(storage="redis", scopes=scopes(10**9))
    gw = BudgetGateway(tmp_path, clock=clock, budgets=budgets, budget_stock=8, **shared)
    async with gw, gw.client() as c:
        for _ in range(2):  # the buckets rebuilt, then eight stocked
            assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))).is_success
        assert (await held_and_used(gw, FLEET))[0] == 8 * EST
        clock.now += timedelta(seconds=30)
        assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))).is_success
        # Not taken: reserved centrally, and its refill gave the eight back for eight new.
        assert stock_of(gw).taken == 0
        assert (await held_and_used(gw, FLEET))[0] == 8 * EST
        assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=98))).is_success
        assert stock_of(gw).taken == 1
        assert (await held_and_used(gw, FLEET))[0] == 7 * EST
