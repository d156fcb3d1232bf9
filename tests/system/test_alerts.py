"""Threshold alerts across two gateway processes on one Redis and one PostgreSQL: 300 concurrent
requests cross 50 %, 80 % and 100 % of one key's day limit, and a webhook receiver gets each
threshold exactly once, signed. Then the same with the gateway that fired the alerts
SIGKILLed right after: the other one's recovery moves them into the outbox and sends them,
still once each."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import anyio
import httpx
import pytest
import sqlalchemy as sa

from spendguard.alerts import SIGNATURE_HEADER, verify
from spendguard.engine.admin import Admin
from spendguard.ledger import Ledger
from spendguard.ledger.schema import records
from spendguard.limits import KeyCodec
from spendguard.money import micros_to_usd
from spendguard.store.redis import RedisStore
from tests.support import clean_env, free_port, stop, uvicorn, wait_healthy
from tests.support.sql import sql_rows
from tests.support.webhook import WebhookReceiver

SECRET = "whsec-system"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello there"}]}
AUTH = {"authorization": "Bearer sk-demo-alpha"}


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def _env(postgres: str, redis: str, receiver: WebhookReceiver, **extra: str) -> dict[str, str]:
    settings = {
        "SPENDGUARD_DATABASE_URL": postgres,
        "SPENDGUARD_REDIS_URL": redis,
        "SPENDGUARD_ALERT_THRESHOLDS": "50,80,100",
        "SPENDGUARD_ALERT_WEBHOOK_URL": receiver.url,
        "SPENDGUARD_ALERT_WEBHOOK_SECRET": SECRET,
        "SPENDGUARD_ALERT_INTERVAL": "0.2",
        "SPENDGUARD_OWNER_TTL": "2",
        # 300 requests at once on a loaded 2-core runner can outlast the default 250 ms per
        # Redis call: a postflight lost to a timeout is not this test's subject (the usage it
        # would have counted reaches Redis only with settlement, which is off here).
        "SPENDGUARD_REDIS_TIMEOUT": "2",
    }
    return clean_env(**{**settings, **extra})


def _serve(
    envs: list[dict[str, str]], tmp_path: Path
) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    procs, bases = [], []
    for n, env in enumerate(envs):
        port, log = free_port(), tmp_path / f"gw{n}.log"
        procs.append(uvicorn("examples.gateway:app", port, env, log))
        bases.append(f"http://127.0.0.1:{port}")
        wait_healthy(bases[-1], procs[-1], log)
    return bases, procs


async def _fire(bases: list[str], count: int) -> list[int]:
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one(i: int) -> None:
            r = await client.post(
                f"{bases[i % len(bases)]}/v1/chat/completions", json=BODY, headers=AUTH
            )
            statuses.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
    return statuses


async def _set_day_limit(env: dict[str, str], micros: int) -> None:
    """The key's day limit through the admin API (the gateways' cached policy is evicted, as
    the CLI does), in this process: no CLI process to start."""
    ledger = Ledger(env["SPENDGUARD_DATABASE_URL"])
    store = RedisStore.from_url(env["SPENDGUARD_REDIS_URL"], timeout=2)
    await ledger.connect()
    try:
        await ledger.init_schema()
        admin = Admin(ledger, store, KeyCodec("quota", timedelta(days=2)))
        await admin.set_policy("acme", "alpha", window="day", limit_usd=micros_to_usd(micros))
    finally:
        await ledger.disconnect()
        await store.aclose()


async def _one_cost(env: dict[str, str], base: str) -> int:
    """One request's estimate, from its record: every later one costs the same (same body,
    same fake answer)."""
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{base}/v1/chat/completions", json=BODY, headers=AUTH)
    assert r.status_code == 200
    query = sa.select(records.c.estimate_micros)
    with anyio.fail_after(10):
        while not (rows := await sql_rows(env["SPENDGUARD_DATABASE_URL"], query)):
            await anyio.sleep(0.05)  # the gateway's record writer batches for 100 ms
    return int(rows[0][0])


def _wait_for(receiver: WebhookReceiver, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(receiver.taken) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # and nothing more after it


def _alert_lines(tmp_path: Path) -> str:
    """What the gateways logged about alerts (fired, moved, delivery failures): the story of a
    missing one."""
    return "\n".join(
        f"{log.name}: {line}"
        for log in sorted(tmp_path.glob("gw*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if any(w in line for w in ("alert", "used", "Redis", "spendguard")) or "timed out" in line
    )


def _check(receiver: WebhookReceiver, tmp_path: Path) -> None:
    got = receiver.taken
    assert sorted(d.json["threshold_percent"] for d in got) == [50, 80, 100], (
        [d.json for d in got],
        _alert_lines(tmp_path),
    )
    ids = [d.headers["idempotency-key"] for d in got]
    assert len(set(ids)) == 3
    for d in got:
        assert verify(SECRET, d.headers[SIGNATURE_HEADER], d.body)
        assert d.json["used_micros"] >= d.json["limit_micros"] * d.json["threshold_percent"] // 100


def _limit_for_300(env: dict[str, str], base: str) -> None:
    """A day limit of the key that 300 requests cross (about 150 requests' worth)."""

    async def set_it() -> None:
        await _set_day_limit(env, 10**9)
        cost = await _one_cost(env, base)
        assert cost > 0
        await _set_day_limit(env, cost * 150)

    anyio.run(set_it)


@pytest.mark.timeout(180)
def test_300_concurrent_requests_on_two_gateways_alert_once_per_threshold(
    clean_postgres_url: str, redis_url: str, receiver: WebhookReceiver, tmp_path: Path
) -> None:
    env = _env(clean_postgres_url, redis_url, receiver, SPENDGUARD_RUN_WORKER="false")
    bases, procs = _serve([env, env], tmp_path)
    try:
        _limit_for_300(env, bases[0])
        time.sleep(1.5)  # the gateways read the policy again (the admin API evicted it)
        statuses = anyio.run(_fire, bases, 300)
        assert statuses.count(200) >= 150 and set(statuses) <= {200, 429}
        _wait_for(receiver, 3, timeout=30)
    finally:
        stop(procs, timeout=20)
    _check(receiver, tmp_path)


@pytest.mark.timeout(180)
def test_alerts_fired_by_a_gateway_killed_right_after_still_arrive_once(
    clean_postgres_url: str, redis_url: str, receiver: WebhookReceiver, tmp_path: Path
) -> None:
    # The firing gateway never moves its alerts by itself (its pass is an hour away); the other
    # settles twice a second, and its recovery finds what the dead one left.
    firing = _env(
        clean_postgres_url,
        redis_url,
        receiver,
        SPENDGUARD_ALERT_INTERVAL="3600",
        SPENDGUARD_RUN_WORKER="false",
    )
    other = _env(clean_postgres_url, redis_url, receiver, SPENDGUARD_SETTLE_INTERVAL="0.5")
    bases, procs = _serve([firing, other], tmp_path)
    try:
        _limit_for_300(firing, bases[0])
        time.sleep(1.5)
        statuses = anyio.run(_fire, bases[:1], 300)
        assert statuses.count(200) >= 150
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        assert receiver.taken == []  # nothing was sent before the kill
        _wait_for(receiver, 3, timeout=60)
    finally:
        stop(procs, timeout=20)
    _check(receiver, tmp_path)
