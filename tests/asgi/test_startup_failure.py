"""A gateway that cannot start (its ledger down) says why in a line or two and exits: no
tracebacks around the one line that matters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import clean_env, free_port
from tests.support.processes import uvicorn


@pytest.mark.timeout(60)
def test_a_ledger_down_at_start_is_one_line_not_two_tracebacks(tmp_path: Path) -> None:
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/gateway"  # nothing listens
    env = clean_env(SPENDGUARD_DATABASE_URL=nowhere)
    log = tmp_path / "gateway.log"
    proc = uvicorn("examples.gateway:app", free_port(), env, log)
    assert proc.wait(timeout=45) != 0
    text = log.read_text()
    assert "spendguard cannot start: cannot connect to the ledger database" in text
    assert "Application startup failed" in text
    assert "Traceback" not in text, text
    assert len(text.splitlines()) < 10, text
