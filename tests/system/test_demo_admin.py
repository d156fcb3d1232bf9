"""The demo gateway's admin routes and metrics as an operator uses them: uvicorn on loopback,
SQLite and the embedded store, the official OpenAI SDK, ``spendguard doctor --gateway``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import ROOT, clean_env, serve_demo

TOKEN = "demo-admin-" + "t" * 24
ADMIN = {"authorization": f"Bearer {TOKEN}"}
MESSAGES = [{"role": "user", "content": "Say something about budgets."}]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'demo.db'}",
        SPENDGUARD_SETTLE_INTERVAL="0.3",
        SPENDGUARD_ADMIN_TOKEN=TOKEN,
    )


@pytest.fixture
def gateway(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    yield from serve_demo(env, tmp_path / "gateway.log")


def doctor(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "spendguard.cli", "doctor", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout)


@pytest.mark.timeout(180)
def test_admin_routes_metrics_and_doctor_on_the_demo_gateway(
    gateway: str, env: dict[str, str]
) -> None:
    alpha = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-demo-alpha", max_retries=0)
    reply = alpha.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.usage is not None

    admin = f"{gateway}/admin/spendguard"
    assert httpx.get(f"{admin}/status").status_code == 401
    assert httpx.get(f"{admin}/status", headers={"authorization": "Bearer nope"}).status_code == 403
    # A limit set over HTTP applies to the gateway's very next request (its own cache).
    put = httpx.put(
        f"{admin}/teams/acme/keys/alpha/policies/day", json={"limit_usd": "0"}, headers=ADMIN
    )
    assert put.status_code == 200 and put.json()["limit_usd"] == "0.000000"
    with pytest.raises(openai.RateLimitError):
        alpha.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
    # The first request was spent before alpha had a day limit: it counts there once the
    # worker (every 0.3 s here) has settled it.
    deadline = time.monotonic() + 15
    while True:
        usage = httpx.get(f"{admin}/teams/acme/keys/alpha/usage", headers=ADMIN).json()
        day = next(r for r in usage["limits"] if r["api_key"] == "alpha" and r["period"] == "day")
        if day["used_micros"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert day["limit_micros"] == 0 and day["remaining_micros"] == 0 and day["used_micros"] > 0

    metrics = httpx.get(f"{gateway}/metrics")
    assert metrics.status_code == 200
    assert "spendguard_records_dropped_total" in metrics.text

    code, found = doctor(env, "--gateway", admin)
    assert code == 0, found
    check = found["gateway"]
    assert check["ok"] is True
    assert check["lifespan"] == "lifespan" and check["running"] is True
    assert check["record_writer"]["running"] is True and check["worker"]["running"] is True
    assert check["store"]["mode"] == "embedded"
    assert "started by the ASGI lifespan" in check["detail"]

    wrong = {**env, "SPENDGUARD_ADMIN_TOKEN": "not-the-token"}
    code, found = doctor(wrong, "--gateway", admin)
    assert code == 1 and found["gateway"]["ok"] is False
    assert "refused" in found["gateway"]["detail"]

    code, found = doctor({**env, "SPENDGUARD_ADMIN_TOKEN": ""}, "--gateway", admin)
    assert code == 1 and "SPENDGUARD_ADMIN_TOKEN" in found["gateway"]["detail"]

    # Without --gateway the doctor checks no gateway.
    code, found = doctor(env)
    assert "gateway" not in found


@pytest.mark.timeout(120)
def test_the_admin_routes_are_off_without_a_token(tmp_path: Path) -> None:
    env = clean_env(SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'demo.db'}")
    for base in serve_demo(env, tmp_path / "gateway.log"):
        admin = f"{base}/admin/spendguard"
        assert httpx.get(f"{admin}/status", headers=ADMIN).status_code == 404
        assert httpx.get(f"{base}/metrics").status_code == 200
        code, found = doctor({**env, "SPENDGUARD_ADMIN_TOKEN": TOKEN}, "--gateway", admin)
        assert code == 1 and "404" in found["gateway"]["detail"]
    with_token = {**env, "SPENDGUARD_ADMIN_TOKEN": TOKEN}
    code, found = doctor(with_token, "--gateway", "http://127.0.0.1:1/admin/spendguard")
    assert code == 1 and "unreachable" in found["gateway"]["detail"]
