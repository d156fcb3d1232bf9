"""Gateway processes sharing one Redis budget: a key exhausted through one is refused by the
other, a reset through the CLI is seen by both at once, and the hold of a gateway killed
mid-request becomes its recovered charge when another gateway recovers it in time, or expires
by itself."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import sqlalchemy as sa

from spendguard.clock import to_micros, utcnow
from spendguard.ledger.schema import records
from spendguard.limits.model import BudgetLimit, SubjectKind
from spendguard.limits.windows import Rolling
from spendguard.store.redis import RedisStore
from spendguard.store.rolling import Bucket, BucketCheck, WindowCheck
from tests.support import RedisCluster, clean_env, free_port, run_cli, stop, uvicorn, wait_healthy
from tests.support.sql import sql_rows

ALPHA = {"authorization": "Bearer sk-demo-alpha"}
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 90}
KEY_BUCKET = BucketCheck(
    Bucket(SubjectKind.API_KEY, "acme:alpha"),
    (WindowCheck(Rolling("daily", "24h", 86_400), BudgetLimit(tokens=95)),),
)


@pytest.fixture(params=["redis", "cluster"])
def env(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        url = cluster.url
    budgets = tmp_path / "budgets.json"
    budgets.write_text(
        json.dumps(
            {
                "enabled": True,
                "storage": "redis",
                "hold_seconds": 10,
                "windows": [{"id": "daily", "period": "24h"}],
                "scopes": {"per_api_key": {"tokens": 95}},
            }
        )
    )
    return clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'ledger.db'}",
        SPENDGUARD_REDIS_URL=url,
        # The session's cluster is shared: a prefix of this test's own.
        SPENDGUARD_KEY_PREFIX=f"gw{uuid.uuid4().hex[:8]}",
        SPENDGUARD_REDIS_TIMEOUT="2",
        SPENDGUARD_BUDGETS_FILE=str(budgets),
    )


@pytest.fixture
def gateways(env: dict[str, str], tmp_path: Path) -> Iterator[list[str]]:
    procs, bases, logs = [], [], []
    try:
        for n in range(2):
            port, log = free_port(), tmp_path / f"gw{n}.log"
            procs.append(uvicorn("examples.gateway:app", port, env, log))
            bases.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        for base, proc, log in zip(bases, procs, logs, strict=True):
            wait_healthy(base, proc, log)
        yield bases
    finally:
        stop(procs, timeout=20)


def post(base: str) -> int:
    return httpx.post(
        f"{base}/v1/chat/completions", json=BODY, headers=ALPHA, timeout=10
    ).status_code


@pytest.mark.timeout(120)
def test_reset_is_seen_by_two_gateway_processes(gateways: list[str], env: dict[str, str]) -> None:
    one, two = gateways
    assert post(one) == 200  # its hold replaced by what it used (well under the estimate)
    assert post(two) == 429  # the second estimate would overrun the shared budget
    assert post(one) == 429
    counters = run_cli(env, "budgets", "inspect")["counters"]
    assert [c["tokens"] for c in counters if c["scope"] == "per_api_key"] != [0]
    assert run_cli(
        env, "budgets", "reset", "--scope", "per_api_key", "--team", "acme", "--api-key", "alpha"
    ) == {"reset": 1}
    assert post(two) == 200
    assert post(one) == 429


def held(env: dict[str, str]) -> bool:
    counters = run_cli(env, "budgets", "inspect")["counters"]
    return any(c["scope"] == "per_api_key" and c["tokens"] >= 90 for c in counters)


@contextlib.contextmanager
def killed_with_a_hold(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, float]]:
    """Two gateway processes; a request whose provider never answers reserves through the
    first, which is then SIGKILLed. Yields the survivor's base URL and when the hold was
    seen in place."""
    port, log = free_port(), tmp_path / "doomed.log"
    doomed = uvicorn("examples.gateway:app", port, env, log)
    survivor_port, survivor_log = free_port(), tmp_path / "survivor.log"
    survivor = uvicorn("examples.gateway:app", survivor_port, env, survivor_log)
    try:
        base, other = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{survivor_port}"
        wait_healthy(base, doomed, log)
        wait_healthy(other, survivor, survivor_log)

        def stalled() -> None:  # the provider never answers; the gateway dies meanwhile
            headers = {**ALPHA, "x-fake-stall-after": "0"}
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{base}/v1/chat/completions", json=BODY, headers=headers, timeout=30)

        threading.Thread(target=stalled, daemon=True).start()
        deadline = time.monotonic() + 20
        while not held(env):  # until the stalled request's hold is in place
            assert time.monotonic() < deadline, "the stalled request never reserved"
            time.sleep(0.05)
        held_at = time.monotonic()
        doomed.kill()
        doomed.wait(10)
        yield other, held_at
    finally:
        stop([doomed, survivor], timeout=20)


@pytest.mark.timeout(120)
def test_a_hold_left_by_a_killed_gateway_expires(env: dict[str, str], tmp_path: Path) -> None:
    with killed_with_a_hold(env, tmp_path) as (other, held_at):
        assert post(other) == 429  # the dead gateway's hold still counts ...
        while post(other) == 429:  # ... until it expires (hold_seconds: 10)
            assert time.monotonic() - held_at < 15, "the hold never expired"
            time.sleep(0.25)
        assert time.monotonic() - held_at >= 5  # expired by its time, not by the kill


async def _bucket_and_records(env: dict[str, str]) -> tuple[int, int, int]:
    """The key's bucket in Redis (tokens held, tokens counted in its window) and the tokens of
    the ledger's records."""
    store = RedisStore.from_url(
        env["SPENDGUARD_REDIS_URL"], prefix=env["SPENDGUARD_KEY_PREFIX"], timeout=2
    )
    try:
        usage = await store.inspect_bucket(KEY_BUCKET, to_micros(utcnow()) // 1000)
    finally:
        await store.aclose()
    rows = await sql_rows(
        env["SPENDGUARD_DATABASE_URL"], sa.select(records.c.input_tokens, records.c.output_tokens)
    )
    return usage.held_tokens, usage.windows[0].tokens, sum(i + o for i, o in rows)


@pytest.mark.timeout(120)
def test_a_killed_gateways_hold_becomes_its_recovered_charge(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The admission entry the killed gateway left is recovered by the survivor's worker (its
    heartbeat lapses after 2 s) before the hold's 10 s are up: the hold becomes what the
    recovered record is charged (its admission estimate, as for the spend limits), in the
    bucket once, and the budget stays spent instead of coming back when the hold would have
    expired (the hold is gone: nothing is left to expire)."""
    env = {**env, "SPENDGUARD_OWNER_TTL": "2", "SPENDGUARD_SETTLE_INTERVAL": "0.5"}
    with killed_with_a_hold(env, tmp_path) as (other, _):
        deadline = time.monotonic() + 8  # within the hold's 10 s
        while (state := anyio.run(_bucket_and_records, env))[2] == 0 or state[0] != 0:
            assert time.monotonic() < deadline, f"never recovered: {state}"
            time.sleep(0.2)
        _, counted, recorded = state
        assert counted == recorded >= 90  # the admission estimate: prompt + max_tokens
        # The hold is gone and its charge counted in the window: nothing is left to expire
        # and give the budget back, and the next request does not fit what is left.
        assert post(other) == 429
