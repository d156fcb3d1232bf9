"""``spendguard doctor --app`` on the LiteLLM proxy wrapped as docs/integrations/litellm.md
shows: with the default routes it reports LiteLLM's inference routes (inside its included
routers, on the FastAPI LiteLLM runs on) as guarded and exits 0; an inference route nobody
guards makes it exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class DoctorRun:
    """``spendguard doctor --app APP --json`` in a process of its own (it imports LiteLLM),
    its output in files (a pipe nobody reads yet could fill up and stall it)."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_doctor(env: dict[str, str], into: Path, app: str) -> DoctorRun:
    name = app.replace(":", ".")
    out, err = into / f"doctor-{name}.json", into / f"doctor-{name}.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spendguard.cli", "doctor", "--app", app, "--json"],
            cwd=into,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
        )
    return DoctorRun(proc, out, err)


def doctor(run: DoctorRun) -> tuple[int, dict[str, Any]]:
    """The exit code and the JSON report of a doctor started by :func:`start_doctor`."""
    code = run.proc.wait(timeout=180)
    try:
        return code, json.loads(run.out.read_text())
    except ValueError:
        raise AssertionError(
            f"doctor wrote no JSON (exit {code}):\n{run.err.read_text()}"
        ) from None


@pytest.fixture(scope="module")
def gateway_dir(tmp_path_factory: pytest.TempPathFactory, provider: Provider) -> Any:
    into = Path(tmp_path_factory.mktemp("litellm-doctor"))
    _, env = litellm_launch(into, provider, "gateway.py", new_master_key())
    write_keys(into, {})
    (into / "unguarded.py").write_text(UNGUARDED)
    init = [sys.executable, "-m", "spendguard.cli", "db", "init"]
    subprocess.run(init, cwd=into, env=env, check=True, capture_output=True, timeout=60)
    return into, env


@pytest.fixture(scope="module")
def doctors(gateway_dir: Any) -> Iterator[dict[str, DoctorRun]]:
    """The doctor of each app, both started at once: each imports LiteLLM for ~10-20 s, and
    one at a time would leave a core idle for as long. Each test reads its own one's report."""
    into, env = gateway_dir
    runs = {app: start_doctor(env, into, app) for app in ("gateway:app", "unguarded:app")}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


def test_doctor_reports_litellm_guarded_and_exits_0(
    doctors: dict[str, DoctorRun],
) -> None:
    code, found = doctor(doctors["gateway:app"])
    routes = found["routes"]
    assert routes["uncovered"] == [] and routes["stray"] == []
    assert set(routes["guarded"]) >= EXPECTED, EXPECTED - set(routes["guarded"])
    assert code == 0, found


def test_doctor_exits_1_on_an_unguarded_inference_route(
    doctors: dict[str, DoctorRun],
) -> None:
    code, found = doctor(doctors["unguarded:app"])
    assert code == 1
    assert found["routes"]["uncovered"] == ["/v2/embeddings"]
    assert not found["routes"]["ok"]
