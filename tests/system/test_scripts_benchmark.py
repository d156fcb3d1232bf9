"""``python -m benchmarks.scripts`` records a warm request's script calls and replays them (its
figures mean nothing here).

Asserted: every script the "everything" gateway sends before and after the provider is
recorded, each replayed call was measured by the server, and an A/B run of the package's own
folder against itself reports both sides. Needs redis-server on PATH and PostgreSQL (the
benchmark starts its own Redis and makes its own database).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, TemporaryDatabase
from tests.support.services import created_database, unavailable

LUA = ROOT / "spendguard" / "store" / "lua"


@pytest.mark.timeout(90)
def test_a_replay_measures_every_script_of_a_request(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not on PATH")
    created_database(TemporaryDatabase()).drop()  # the server is there and lets us create one
    out = tmp_path / "scripts.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scripts",
            "--requests",
            "40",
            "--lua",
            str(LUA),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ),  # SPENDGUARD_TEST_POSTGRES_URL names the server to use
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    scripts = result["scripts"]
    # The key's budget reserve (the model's and the fleet's holds were stocked ahead), a
    # commit per bucket (the key's, the model's, the fleet's), the provider lease and its
    # settlement, the spend limits' pre- and postflight.
    assert {name: s["calls_per_request"] for name, s in scripts.items()} == {
        "preflight": 1,
        "postflight": 1,
        "bucket_reserve": 1,
        "bucket_commit": 3,
        "pool_acquire": 1,
        "pool_settle": 1,
    }
    for name, s in scripts.items():
        assert s["A"] > 0 and s["B"] > 0, name
    for label in ("A", "B"):
        total = sum(s[label] * s["calls_per_request"] for s in scripts.values())
        assert result["per_request"][label] == pytest.approx(total)
    assert "| per request |" in done.stdout
