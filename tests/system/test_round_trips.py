"""Every request-path feature on, and still one Redis round trip before the provider and one
after, counted on the wire by a proxy between the gateway and Redis: a hard key limit, a team
limit, a prepaid balance, model lists on the key and the team, rates on both, budgets for the
key, the model and the fleet, threshold alerts, and a provider key leased from declared
candidates. On one
redis-server, and on a 3-master Cluster whose nodes announce the proxies' ports (so the
client's every connection goes through one)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from spendguard.engine.carryover import RIDE_AT
from spendguard.limits import Period
from spendguard.providers import ProviderKey
from spendguard.store.redis import RedisStore
from tests.support import Clock, RedisCluster, Rounds, TcpProxy, chat_body
from tests.support.budgets import BudgetGateway, section

pytestmark = pytest.mark.anyio

SCOPES = {
    "per_api_key": {"tokens": 10**9, "cost_usd": 1000},
    "per_model": {"unit-model": {"tokens": 10**9}},
    "global": {"tokens": 10**9, "cost_usd": 1000},
    # An end user, two tags and a customer above the team: their buckets join the same writes.
    "per_end_user": {"tokens": 10**9},
    "per_tag": {"*": {"tokens": 10**9}},
    "per_customer": {"globex": {"tokens": 10**9, "cost_usd": 1000}},
}
PARTIES = {"x-end-user": "user-7", "x-tags": "search,beta", "x-customer": "globex"}
WARM, MEASURED = 3, 6


@asynccontextmanager
async def single(redis_port: int, rounds: Rounds) -> AsyncIterator[str]:
    async with TcpProxy(redis_port, rounds=rounds) as proxy:
        yield f"redis://127.0.0.1:{proxy.port}/0"


@asynccontextmanager
async def cluster(rounds: Rounds) -> AsyncIterator[str]:
    with RedisCluster() as nodes:
        async with AsyncExitStack() as stack:
            proxies = [
                await stack.enter_async_context(TcpProxy(node.port, rounds=rounds))
                for node in nodes.servers
            ]
            # Each node tells clients to reach it through its proxy.
            for node, proxy in zip(nodes.servers, proxies, strict=True):
                node.cli("CONFIG", "SET", "cluster-announce-port", str(proxy.port))
            wanted = {str(p.port) for p in proxies}
            deadline = time.monotonic() + 20
            while not wanted <= set(nodes.servers[0].cli("CLUSTER", "SLOTS").split()):
                assert time.monotonic() < deadline, "the nodes never announced the proxies"
                await anyio.sleep(0.05)
            yield f"redis+cluster://127.0.0.1:{proxies[0].port}"


async def everything_on(gw: BudgetGateway) -> None:
    admin = gw.guard.admin
    await admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1000, hard=True)
    await admin.set_policy("acme", None, window=Period.MONTH, limit_usd=1000)
    await admin.topup("acme", 1000)
    await admin.allow_models("acme", "alpha", ["unit-*"])
    await admin.allow_models("acme", None, ["unit-*", "gpt-*"])
    for key in ("alpha", None):
        await admin.set_rates("acme", key, rpm=10**6, tpm=10**9, max_parallel=1000)
    await gw.guard.pool.register(ProviderKey("upstream-1", "fake", tpm=10**9, rpm=10**6))


async def measured_rounds(
    tmp_path: Path,
    wiring: Any,
    rounds: Rounds,
    scopes: dict[str, Any],
    parties: dict[str, str],
    measured: int = MEASURED,
) -> list[set[object]]:
    """``measured`` warm inferences with every feature on (and ``scopes``' budgets): the
    round trips they sent, each as the proxies (nodes) it wrote to."""
    async with wiring as url:
        spend = RedisStore.from_url(url, timeout=2.0)
        gw = BudgetGateway(
            tmp_path,
            clock=Clock(datetime.now(UTC)),  # Redis expires keys at absolute times: real ones
            store=spend,
            budgets=section(storage="redis", scopes=scopes),
            redis_url=url,
            key_prefix=f"rt{uuid.uuid4().hex[:8]}",
            redis_timeout=2.0,
            remaining_headers=True,
            provider_candidates={"unit-*": ["upstream-1"]},
            # Threshold alerts are checked in the postflight script; moving a fired one into
            # the outbox is a background pass (off the request path: not in this count).
            alert_thresholds="1,50,100",
            alert_interval=3600,
            end_user_from="header:x-end-user",
            tags_from="header:x-tags",
            customer_from="header:x-customer",
        )
        async with gw, gw.client() as c:
            await everything_on(gw)
            for _ in range(WARM):  # policies cached, buckets seeded, scripts loaded
                r = await c.post(
                    "/v1/chat/completions", json=chat_body(max_tokens=10), headers=parties
                )
                assert r.status_code == 200, r.text
            await gw.guard.recorder.flush()
            # Records go to the background writer: its ledger writes (and the admission
            # entries it then closes) are off the request path, not counted here.
            held: list[Any] = []
            gw.guard.recorder.submit = held.append  # type: ignore[method-assign]
            before = rounds.count
            for _ in range(measured):
                r = await c.post(
                    "/v1/chat/completions", json=chat_body(max_tokens=10), headers=parties
                )
                assert r.status_code == 200, r.text
                assert "x-ratelimit-remaining-requests" in r.headers  # the rates were counted
                assert "x-budget-api-key-remaining" in r.headers  # so was the key's budget
            sent = rounds.nodes[before:]
            assert len(held) == measured
            state = await gw.guard.pool.state("upstream-1")
            assert state is not None and state.requests == WARM + measured  # every one leased
            counted = {c.scope.value for c in (await gw.budgets.inspect()).counters if c.tokens}
            assert {s for s in scopes if s != "global"} <= counted
        await spend.aclose()
    return sent


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_two_round_trips_per_warm_inference_with_everything_on(
    tmp_path: Path, request: pytest.FixtureRequest, where: str
) -> None:
    rounds = Rounds()
    if where == "redis":
        port: int = request.getfixturevalue("shared_redis").port
        wiring = single(port, rounds)
    else:
        wiring = cluster(rounds)
    sent = await measured_rounds(tmp_path, wiring, rounds, SCOPES, PARTIES)
    assert len(sent) == 2 * MEASURED


async def test_a_cluster_round_writes_to_the_teams_node_and_the_shared_one(
    tmp_path: Path,
) -> None:
    """Everything on but tags and customers (whose buckets span teams, in slots of their own):
    the spend keys, the key's and the end user's budgets live in the team's slot, the model's
    and the fleet's budgets and the provider pool in the shared one, so each round writes to
    two nodes at most. (Here the team and the shared slot are on different nodes, and the
    key's, the model's and the fleet's own hash tags would have been on a third.)

    And the finishing round writes to the team's node alone: the shared slot's finishing
    writes (the stocked holds' commits, the lease's settlement) wait to be carried by one
    finishing round in eight, which none of these is."""
    rounds = Rounds()
    scopes = {k: v for k, v in SCOPES.items() if k not in ("per_tag", "per_customer")}
    sent = await measured_rounds(
        tmp_path, cluster(rounds), rounds, scopes, {"x-end-user": PARTIES["x-end-user"]}
    )
    assert [len(nodes) for nodes in sent] == [2, 1] * MEASURED
    team_node = sent[1]
    assert all(nodes == team_node for nodes in sent[1::2])  # every finish: the team's node
    assert all(team_node < nodes for nodes in sent[::2])  # every admission: it and the shared


async def test_every_eighth_finishing_round_carries_the_shared_slots_writes(
    tmp_path: Path,
) -> None:
    """The finishing rounds that write to the team's node alone leave the shared slot's
    writes waiting; the one that finds ``RIDE_AT`` requests' waiting carries them all, in its
    own write (the team's node and the shared one), and every request is counted there."""
    rounds = Rounds()
    scopes = {k: v for k, v in SCOPES.items() if k not in ("per_tag", "per_customer")}
    sent = await measured_rounds(
        tmp_path,
        cluster(rounds),
        rounds,
        scopes,
        {"x-end-user": PARTIES["x-end-user"]},
        measured=RIDE_AT,
    )
    assert [len(nodes) for nodes in sent[1::2]] == [1] * (RIDE_AT - 1) + [2]
    assert all(len(nodes) == 2 for nodes in sent[::2])
