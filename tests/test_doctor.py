"""Tests for spendguard.doctor through ``spendguard doctor``: effective settings with secrets
redacted, the database and the store reached (never created), the routes against an app's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from spendguard.cli import main
from tests.support import free_port

APP_MODULE = """
from fastapi import FastAPI
from starlette.routing import Mount

llm = FastAPI()


@llm.post("/text/completions")
async def embed() -> dict:
    return {}


app = FastAPI(routes=[Mount("/llm", app=llm)])
"""


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def sqlite_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "ledger.db"
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", f"sqlite:///{path}")
    return path


def test_a_healthy_setup(
    sqlite_db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["db", "init"]) == 0
    capsys.readouterr()
    code, found = doctor(capsys)
    assert code == 0
    assert all(check["ok"] for check in found.values())
    assert found["database"]["detail"] == f"SQLite file {sqlite_db}: reachable"
    assert found["settings"]["routes"][0] == "/v1/chat/completions"
    assert found["store"]["url"] is None
    code = main(["doctor"])  # the readable form too
    out = capsys.readouterr().out
    assert code == 0 and "ok  database" in out and "key_prefix = quota" in out


def test_a_missing_sqlite_file_is_reported_and_not_created(
    sqlite_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, found = doctor(capsys)
    assert code == 1
    assert found["database"]["ok"] is False and found["database"]["exists"] is False
    assert "does not exist" in found["database"]["detail"]
    assert not sqlite_db.exists()


def test_secrets_are_redacted_and_an_unreachable_store_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", "postgresql://gw:hunter2@127.0.0.1:1/ledger")
    monkeypatch.setenv("SPENDGUARD_REDIS_URL", f"redis://:sesame@127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("SPENDGUARD_DB_TIMEOUT", "2")
    code = main(["doctor", "--json"])
    out = capsys.readouterr().out
    assert code == 1
    assert "hunter2" not in out and "sesame" not in out
    found = json.loads(out)
    assert found["settings"]["database_url"] == "postgresql://gw:***@127.0.0.1:1/ledger"
    assert found["database"]["ok"] is False and "unreachable" in found["database"]["detail"]
    assert found["store"]["ok"] is False and "unreachable" in found["store"]["detail"]


def test_routes_are_checked_against_the_app(
    sqlite_db: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    main(["db", "init"])
    (tmp_path / "mounted_gateway.py").write_text(APP_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    monkeypatch.delitem(sys.modules, "mounted_gateway", raising=False)
    capsys.readouterr()
    code, found = doctor(capsys, "--app", "mounted_gateway:app")
    assert code == 1
    routes = found["routes"]
    assert routes["uncovered"] == ["/llm/text/completions"]
    assert routes["guarded"] == []

    monkeypatch.setenv("SPENDGUARD_ROUTES", "/llm/text/completions")
    code, found = doctor(capsys, "--app", "mounted_gateway:app")
    assert code == 0 and found["routes"]["uncovered"] == [] and found["routes"]["unmatched"] == []
    assert found["routes"]["guarded"] == ["/llm/text/completions"]


ROUTER_MODULE = """
from fastapi import APIRouter, Depends, FastAPI

from spendguard.asgi import spendguard_guard


async def auth() -> None: ...


inner = APIRouter(prefix="/openai")
llm = APIRouter(dependencies=[Depends(auth), Depends(spendguard_guard)])


@llm.post("/v1/chat/completions")
@llm.post("/chat/completions")
@inner.post("/deployments/{model:path}/chat/completions")
async def chat() -> dict:
    return {}


@llm.post("/v1/threads/{thread_id}/messages")  # a resource, not an inference
@llm.post("/key/generate")
async def other() -> dict:
    return {}


EXTRA = "/v2/embeddings"
llm.include_router(inner)
app = FastAPI()
app.include_router(llm, prefix="")
"""


@pytest.mark.parametrize("extra", [False, True])
def test_routes_inside_included_routers_are_checked(
    sqlite_db: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    extra: bool,
) -> None:
    """FastAPI >= 0.137 keeps an included router as one node of ``app.routes``: the check
    sees its routes all the same, and an unguarded inference-looking one fails it."""
    main(["db", "init"])
    name = f"router_gateway_{extra}"
    module = ROUTER_MODULE + ("\nllm.post(EXTRA)(chat)\n" if extra else "")
    (tmp_path / f"{name}.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    capsys.readouterr()
    code, found = doctor(capsys, "--app", f"{name}:app")
    routes = found["routes"]
    assert set(routes["guarded"]) == {
        "/v1/chat/completions",
        "/chat/completions",
        "/openai/deployments/{model:path}/chat/completions",
    }
    assert set(routes["deferred"]) == set(routes["guarded"])
    if extra:
        assert code == 1 and routes["uncovered"] == ["/v2/embeddings"]
    else:
        assert code == 0 and routes["uncovered"] == [] and routes["stray"] == []


def test_an_app_that_cannot_be_found_is_a_usage_error(
    sqlite_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--app", "no_such_module_here:app"]) == 2
    assert "--app" in capsys.readouterr().err
