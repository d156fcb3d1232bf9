"""The README as a newcomer uses it: its two commands, its "Try it" against the demo gateway,
and its whole gateway served by uvicorn and driven by the shell block after it. Also: the
generated reference pages match the code, and the manual builds as a site with no broken
link or anchor."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, clean_env, free_port, serve_demo
from tests.support.processes import stop, uvicorn

from .blocks import Block, blocks_of, marked

README = ROOT / "README.md"
ANSWER = re.compile(r'"object":\s*"chat\.completion"')
DEMO_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[demo]' && "
    "uvicorn examples.gateway:app --port 8000"
)
TEST_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && pytest"


def shell(block: Block, base: str, env: dict[str, str], cwd: Path) -> str:
    """Run a README shell block against the server at ``base`` (for the port it names)."""
    code = re.sub(r"localhost:80\d\d", base.removeprefix("http://"), block.code)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_two_commands_are_on_the_first_screen() -> None:
    head = "\n".join(README.read_text().splitlines()[:40])
    assert DEMO_COMMAND in head and TEST_COMMAND in head
    # CI runs the README's test command, so it cannot rot.
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_one_screen_and_a_manual_behind_it() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, len(lines)
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    missing = [link for link in links if not (ROOT / link).exists()]
    assert links and not missing, missing


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'spendguard.db'}",
        SPENDGUARD_SETTLE_INTERVAL="1",
    )


@pytest.mark.timeout(120)
def test_try_it_against_the_demo(env: dict[str, str], tmp_path: Path) -> None:
    (block,) = marked("run-with", "demo")
    assert block.page == README
    for base in serve_demo(env, tmp_path / "demo.log"):
        out = shell(block, base, env, tmp_path)
        assert '"code":"spend_limit_exceeded"' in out  # alpha, refused at $0
        assert "API Key daily spend limit exceeded: limit $0.00, resets at " in out
        assert ANSWER.search(out)  # beta, answered
        assert "key beta" in out  # its spend, settled by the CLI or the gateway's worker


@pytest.fixture
def readme_gateway(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """The README's gateway, saved as the page says, under uvicorn on a free port."""
    (block,) = marked("file", "gateway.py")
    (tmp_path / "gateway.py").write_text(block.code)
    port = free_port()
    log = tmp_path / "gateway.log"
    served = {**env, "PYTHONPATH": f"{tmp_path}:{env['PYTHONPATH']}"}
    proc = uvicorn("gateway:app", port, served, log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/docs", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield base
    finally:
        stop([proc], timeout=15)
    assert "Application shutdown complete" in log.read_text()


@pytest.mark.timeout(120)
def test_the_whole_gateway_runs_as_pasted(
    readme_gateway: str, env: dict[str, str], tmp_path: Path
) -> None:
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    unknown = httpx.post(f"{readme_gateway}/v1/chat/completions", json=chat, timeout=10)
    assert unknown.status_code == 401  # a key not in KEYS
    (block,) = marked("run-with", "gateway.py")
    out = shell(block, readme_gateway, env, tmp_path)
    # Three answers at $0.000004 each, then the fourth refused: $0.000012 of $0.000010 used.
    assert len(ANSWER.findall(out)) == 3, out
    assert out.count('"code":"spend_limit_exceeded"') == 1, out
    assert out.rindex("spend_limit_exceeded") > out.rindex("chat.completion"), out
    assert "used $0.000012 of $0.000010, $0.000000 left" in out, out


def test_generated_reference_pages_match_the_code() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_reference.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_configuration_page_lists_every_setting_once() -> None:
    from spendguard import Settings

    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert page.count(f"| `SPENDGUARD_{name.upper()}` |") == 1, name


def test_the_cli_page_lists_every_command() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    for command in ("models allow", "models rm", "models ls", "balance mode", "policy set"):
        assert f"## spendguard {command}\n" in page, command
    assert "`--mode` `MODE`" in page


@pytest.mark.timeout(120)
def test_the_manual_builds_with_no_broken_link(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_every_readme_block_is_accounted_for() -> None:
    blocks = blocks_of(README)
    assert [b.marker for b in blocks] == ["fragment", "fragment", "run-with", "file", "run-with"]
