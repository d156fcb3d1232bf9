"""``spendguard doctor --app`` on the LiteLLM proxy wrapped as docs/integrations/litellm.md
shows: with the default routes it reports LiteLLM's inference routes (inside its included
routers, on the FastAPI LiteLLM runs on) as guarded and exits 0; an inference route nobody
guards makes it exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .litellm_gateway import litellm_launch, new_master_key
from .support import Provider, write_keys

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("litellm_installed")]

# Served by LiteLLM 1.108.7 at import (the lazily added /v1/messages is not among them).
EXPECTED = {
    "/chat/completions",
    "/v1/chat/completions",
    "/openai/deployments/{model:path}/chat/completions",
    "/engines/{model:path}/chat/completions",
    "/completions",
    "/v1/completions",
    "/embeddings",
    "/v1/embeddings",
    "/responses",
    "/v1/responses",
    "/openai/v1/responses",
    "/v1/responses/compact",
    "/queue/chat/completions",
    "/cursor/chat/completions",
}
UNGUARDED = """
from gateway import app


@app.post("/v2/embeddings")
async def embeddings() -> dict:
    return {}
"""


def doctor(env: dict[str, str], into: Path, app: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "spendguard.cli", "doctor", "--app", app, "--json"],
        cwd=into,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done.returncode, json.loads(done.stdout)


@pytest.fixture(scope="module")
def gateway_dir(tmp_path_factory: pytest.TempPathFactory, provider: Provider) -> Any:
    into = Path(tmp_path_factory.mktemp("litellm-doctor"))
    _, env = litellm_launch(into, provider, "gateway.py", new_master_key())
    write_keys(into, {})
    (into / "unguarded.py").write_text(UNGUARDED)
    init = [sys.executable, "-m", "spendguard.cli", "db", "init"]
    subprocess.run(init, cwd=into, env=env, check=True, capture_output=True, timeout=60)
    return into, env


def test_doctor_reports_litellm_guarded_and_exits_0(gateway_dir: Any) -> None:
    into, env = gateway_dir
    code, found = doctor(env, into, "gateway:app")
    routes = found["routes"]
    assert routes["uncovered"] == [] and routes["stray"] == []
    assert set(routes["guarded"]) >= EXPECTED, EXPECTED - set(routes["guarded"])
    assert code == 0, found


def test_doctor_exits_1_on_an_unguarded_inference_route(gateway_dir: Any) -> None:
    into, env = gateway_dir
    code, found = doctor(env, into, "unguarded:app")
    assert code == 1
    assert found["routes"]["uncovered"] == ["/v2/embeddings"]
    assert not found["routes"]["ok"]
