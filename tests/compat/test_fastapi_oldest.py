"""The ``Depends`` recipe of docs/getting-started.md on the oldest FastAPI spendguard
supports, in a child process.

FastAPI 0.110.1 is the first release that accepts a Starlette spendguard runs on
(``starlette>=0.37``: 0.110.0 pins ``starlette<0.37``), and it requires ``starlette>=0.37.2``.
The two are installed once, without their dependencies, into a directory of their own (kept in
pytest's cache, by version) that leads the child's ``PYTHONPATH``, so they shadow the FastAPI
and Starlette of the environment while everything else (pydantic, httpx, spendguard from this
checkout) stays as installed. The child checks it really imported them.

Until FastAPI 0.137 ``include_router()`` copied the router's routes into ``app.routes``; later
releases keep one node for the included router. The recipe must work both ways: the current
FastAPI is covered by tests/asgi/test_dependency.py, this file covers the oldest.

A failed install skips the test locally and FAILS it under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, clean_env
from tests.support.services import unavailable

OLDEST_FASTAPI = "0.110.1"
ITS_STARLETTE = "0.37.2"  # the oldest Starlette FastAPI 0.110.1 accepts

# The child: the recipe with router-level dependencies and an include_router() prefix, a valid
# key admitted and charged, a bad key left to the app's own 401, a $0 key limit refused.
CHILD = r"""
import asyncio
import json
import sys
from pathlib import Path

import fastapi
import sqlalchemy as sa
import starlette
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from starlette.responses import JSONResponse

import spendguard
from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import spendguard_guard
from spendguard.ledger.schema import records
from spendguard.limits import Period
from tests.support import MODEL, chat_body, client, lifespan, sql_rows, write_unit_prices

packages, root, directory, want_fastapi, want_starlette = sys.argv[1:]
assert fastapi.__version__ == want_fastapi, fastapi.__version__
assert starlette.__version__ == want_starlette, starlette.__version__
for module in (fastapi, starlette):
    assert Path(module.__file__).is_relative_to(packages), module.__file__
assert Path(spendguard.__file__).is_relative_to(root), spendguard.__file__

KEYS = {"sk-alpha": ("acme", "alpha")}
ALPHA = {"authorization": "Bearer sk-alpha"}
calls = []


async def auth(request: Request, authorization: str = Header("")) -> None:
    found = KEYS.get(authorization.removeprefix("Bearer "))
    if found is None:
        raise HTTPException(401, "unknown key")
    request.state.team_id, request.state.api_key_id = found


async def chat(request: Request) -> JSONResponse:
    calls.append(1)
    body = await request.json()
    usage = {"prompt_tokens": 10, "completion_tokens": 5}
    return JSONResponse({"object": "chat.completion", "model": body["model"], "usage": usage})


async def main() -> dict:
    url = f"sqlite:///{Path(directory) / 'ledger.db'}"
    settings = Settings(
        database_url=url, prices=write_unit_prices(Path(directory)), run_worker=False
    )
    guard = SpendGuard(settings)
    router = APIRouter(dependencies=[Depends(auth), Depends(spendguard_guard)])
    router.post("/chat/completions")(chat)
    app = FastAPI()
    app.include_router(router, prefix="/v1")
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    out = {}
    async with lifespan(app), client(app) as c:
        ok = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        out["valid"] = [ok.status_code, "x-spendguard-inference-id" in ok.headers]
        bad = await c.post("/v1/chat/completions", json=chat_body(), headers={"authorization": "x"})
        out["bad key"] = [bad.status_code, bad.json()]
        await guard.recorder.flush()
        out["unsettled"] = list(await guard.ledger.unsettled())
        query = sa.select(records.c.team_id, records.c.api_key_id, records.c.route, records.c.model)
        out["records"] = [list(row) for row in await sql_rows(url, query)]
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=0)
        over = await c.post("/v1/chat/completions", json=chat_body(), headers=ALPHA)
        out["over the limit"] = [over.status_code, over.json()["error"]["code"]]
    out["provider calls"] = len(calls)
    out["model"] = MODEL
    return out


print(json.dumps(asyncio.run(main())))
"""


def _cache_root(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    if cache is not None:
        return Path(cache.mkdir("spendguard-old-packages"))
    return tmp_path_factory.getbasetemp() / "old-packages"


@pytest.fixture(scope="module")
def oldest_fastapi(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A directory holding only FastAPI 0.110.1 and Starlette 0.37.2 (installed once)."""
    base = _cache_root(request.config, tmp_path_factory)
    target = base / f"fastapi-{OLDEST_FASTAPI}-starlette-{ITS_STARLETTE}"
    done = target / ".installed"
    if done.exists():
        return target
    if importlib.util.find_spec("pip") is None:
        unavailable("pip is not installed: cannot install the oldest FastAPI")
    base.mkdir(parents=True, exist_ok=True)
    partial = base / f"{target.name}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input"]
    command += ["--disable-pip-version-check", "--target", str(partial)]
    command += [f"fastapi=={OLDEST_FASTAPI}", f"starlette=={ITS_STARLETTE}"]
    try:
        installed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        unavailable(f"pip could not install fastapi=={OLDEST_FASTAPI}: {exc!r}")
    if installed.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        unavailable(
            f"pip could not install fastapi=={OLDEST_FASTAPI} starlette=={ITS_STARLETTE}: "
            f"{installed.stderr[-2000:]}"
        )
    (partial / ".installed").write_text(f"{OLDEST_FASTAPI} {ITS_STARLETTE}\n")
    try:
        partial.rename(target)  # all at once: a concurrent run sees all of it or none
    except OSError:  # a concurrent run got there first (or a broken leftover is in the way)
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
        else:
            shutil.rmtree(partial, ignore_errors=True)
    return target


def test_the_depends_recipe_through_include_router_on_the_oldest_fastapi(
    oldest_fastapi: Path, tmp_path: Path
) -> None:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(oldest_fastapi), str(ROOT), os.environ.get("PYTHONPATH")])
    )
    args = [str(oldest_fastapi), str(ROOT), str(tmp_path), OLDEST_FASTAPI, ITS_STARLETTE]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen["valid"] == [200, True]
    assert seen["bad key"] == [401, {"detail": "unknown key"}]
    assert seen["unsettled"] == [1, 15]  # the one admitted inference, 10 + 5 tokens
    assert seen["records"] == [["acme", "alpha", "/v1/chat/completions", seen["model"]]]
    assert seen["over the limit"] == [429, "spend_limit_exceeded"]
    assert seen["provider calls"] == 1
