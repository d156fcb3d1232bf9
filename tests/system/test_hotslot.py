"""``python -m benchmarks.hotslot --quick`` runs and reports (its figures mean nothing here).

Asserted: the JSON's sections, a measured rate above 0 for every Redis scenario with no bad
reply, and the simulation's exact modes never over-admitting. Needs redis-server on PATH (the
benchmark starts its own on a free loopback port).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_quick_hotslot_run_reports_ceiling_and_simulation(tmp_path: Path) -> None:
    out = tmp_path / "hotslot.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotslot", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "admissions/s" in done.stdout and "| central |" in done.stdout

    results = json.loads(out.read_text())
    ceiling = results["ceiling"]
    expected = {"admission", "admission, fresh bucket", "reserve only", "commit only", "preflight"}
    assert set(ceiling["scenarios"]) == expected
    for name, runs in ceiling["scenarios"].items():
        for run in runs:
            assert run["executions_per_s"] > 0, name
            assert run["errors"] == 0, (name, run)
            assert run["evalsha_usec_per_call"] > 0, name
            assert 0 < run["server_cpu_pct"] <= 200, name
    assert ceiling["summary"]["admission"]["admissions_per_s"] > 0

    modes = {m["mode"]: m for m in results["simulation"]["modes"]}
    assert modes["central"]["over_admission_tokens"]["max"] == 0
    assert modes["central"]["spurious_refusals"]["max"] == 0
    assert modes["central"]["hot_slot_calls_per_admission_below_90pct"]["median"] == 1.0
    for name, mode in modes.items():
        if mode["over_admission_bound_tokens"] == "0":  # the exact designs
            assert mode["over_admission_tokens"]["max"] == 0, name
        assert mode["admitted_over_limit"]["median"] > 0.9, name
