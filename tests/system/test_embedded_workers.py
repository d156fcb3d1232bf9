"""The demo gateway under ``uvicorn --workers 2`` on the embedded store and one SQLite file.

The embedded store counts in one process, so a second worker would admit every limit once
more. It is refused at start: its lifespan fails, naming the worker that holds the database,
and uvicorn then stops the whole server (a worker that fails to start stops its parent). What
was served meanwhile is one process's worth: of the requests answered, the first five (the
key's limit) are admitted and charged, the rest refused. One worker, the remedy the refusal
names, then serves on the same ledger (nothing the stopped processes left behind blocks it) and
admits the rest of the limit: five of all the requests, charged exactly the limit.
"""

from __future__ import annotations

import re
import subprocess
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from spendguard.engine.pricing import PriceTable
from spendguard.testing import expected_usage
from tests.support import call_cli, clean_env, free_port, run_cli, serve_demo, stop, uvicorn

ALPHA_DAY = ("--team", "acme", "--api-key", "alpha", "--period", "day")
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
ALPHA = {"authorization": "Bearer sk-demo-alpha"}
TOKEN = "embedded-workers-" + "t" * 24
ADMIN = {"authorization": f"Bearer {TOKEN}"}
REQUESTS = 20
ADMITTED = 5  # the key's day limit is the cost of this many requests


def cost() -> int:
    charge = PriceTable.load().cost(BODY["model"], expected_usage("/v1/chat/completions", BODY))
    assert charge is not None and charge > 0
    return int(charge)


def send(base: str, each: int, proc: subprocess.Popen[bytes] | None = None) -> list[int]:
    """Up to ``REQUESTS`` chat requests, one after the other: their status codes. With
    ``proc``: from the moment the server answers until it is gone.

    A response ends before the gateway charges it, so after each admitted one the next waits
    until the gateway's cache holds its charge: a soft limit then admits exactly what fits."""
    codes: list[int] = []
    used = 0
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=base, timeout=10) as client:
        while len(codes) < REQUESTS and time.monotonic() < deadline:
            try:
                status = client.post("/v1/chat/completions", json=BODY, headers=ALPHA).status_code
                codes.append(status)
                if status == 200:
                    used += each
                    while charged(client) < used:
                        assert time.monotonic() < deadline, (codes, used)
                        time.sleep(0.01)
            except httpx.TransportError:
                if proc is None or codes or proc.poll() is not None:
                    break  # gone (or, before the first answer, it never came up)
                time.sleep(0.05)
    return codes


def charged(client: httpx.Client) -> int:
    """Alpha's day usage as the answering gateway's cache has it (pending charges included)."""
    reply = client.get("/admin/spendguard/teams/acme/keys/alpha/usage", headers=ADMIN)
    assert reply.status_code == 200, reply.text
    day = next(
        r for r in reply.json()["limits"] if r["api_key"] == "alpha" and r["period"] == "day"
    )
    used: int = day["used_micros"]
    return used


def settled(env: dict[str, str]) -> int:
    # In process: the gateway's workers are real processes, and the CLI's own process is shown
    # by the policy below (and by settle and usage in test_demo_gateway).
    call_cli(env, "settle")
    usage = call_cli(env, "usage", "--team", "acme")
    assert usage["unsettled_records"] == 0, usage
    total: int = usage["charges_total_micros"]
    return total


@pytest.mark.timeout(300)
def test_two_workers_on_the_embedded_store_admit_one_process_worth(tmp_path: Path) -> None:
    env = clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'demo.db'}",
        SPENDGUARD_SETTLE_INTERVAL="0.3",
        SPENDGUARD_ADMIN_TOKEN=TOKEN,
    )
    each = cost()
    limit = ADMITTED * each
    run_cli(env, "policy", "set", *ALPHA_DAY, "--limit-usd", str(Decimal(limit) / 1_000_000))

    port, log = free_port(), tmp_path / "workers.log"
    proc = uvicorn("examples.gateway:app", port, env, log, "--workers", "2")
    try:
        codes = send(f"http://127.0.0.1:{port}", each, proc)
        # The refused worker stops the server by itself: nothing runs on with half its workers.
        proc.wait(timeout=60)
    finally:
        stop([proc])
    text = log.read_text()

    workers = set(re.findall(r"Started server process \[(\d+)\]", text))
    failed = re.findall(r"Child process \[(\d+)\] failed to start", text)
    holder = re.findall(r"another process \(pid (\d+)\) already runs it on the database", text)
    assert len(workers) == 2 and len(failed) == 1 and holder, text
    assert holder[0] in workers and holder[0] != failed[0], text
    assert "spendguard refused to start: the embedded store (no SPENDGUARD_REDIS_URL)" in text
    assert "set SPENDGUARD_REDIS_URL" in text

    # Whatever the survivor answered before the server stopped: one process's admissions.
    admitted = min(len(codes), ADMITTED)
    assert codes == [200] * admitted + [429] * (len(codes) - admitted), codes
    assert settled(env) == admitted * each

    # One worker on the same ledger admits the rest of the limit, and no more.
    for base in serve_demo(env, tmp_path / "one.log"):
        again = send(base, each)
    rest = ADMITTED - admitted
    assert again == [200] * rest + [429] * (REQUESTS - rest), again
    assert settled(env) == limit
