"""Every code block of the README and of docs/ is run, checked, or marked a fragment on purpose.

An unmarked block is run by its language: ``python`` as a script in a directory of its own
(an ``app`` it defines is started and stopped through its lifespan), ``sh`` with bash,
``console`` command by command with each output compared, ``json`` and ``yaml`` parsed.
``text`` (and a bare fence) is output or a diagram, not code. Marked blocks are run elsewhere
(see blocks.py); this module checks each marker points at something real.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT, clean_env

from .blocks import Block, all_blocks

RUN_BY_LANGUAGE = {"python", "sh", "console", "json", "yaml"}
NOT_CODE = {"", "text"}
MARKERS = {"fragment", "compat-test", "same-as", "file", "run-with"}
BLOCKS = all_blocks()

# Run a block, then start and stop the app it defines (its lifespan: spendguard's start-up
# checks, its database, its budgets) so a block that only imports cleanly does not pass.
HARNESS = """
import runpy, sys
namespace = runpy.run_path(sys.argv[1])
app = namespace.get("app")
if app is not None:
    from starlette.testclient import TestClient
    with TestClient(app):
        pass
"""


def unmarked(*langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.marker is None and b.lang in langs]


def ids(block: Block) -> str:
    return block.where


def env_for(tmp_path: Path) -> dict[str, str]:
    return clean_env(SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'spendguard.db'}")


def test_every_block_is_run_checked_or_a_fragment() -> None:
    problems = []
    for b in BLOCKS:
        if b.marker is None and b.lang not in RUN_BY_LANGUAGE | NOT_CODE:
            problems.append(f"{b.where}: a {b.lang} block: make it runnable or mark it a fragment")
        elif b.marker is not None and b.marker not in MARKERS:
            problems.append(f"{b.where}: unknown marker {b.marker!r}")
        elif b.marker == "fragment" and not b.argument:
            problems.append(f"{b.where}: a fragment says why it is one (<!-- fragment: why -->)")
    assert not problems, "\n".join(problems)
    assert len(BLOCKS) > 40  # the parser found the pages' blocks


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "fragment"], ids=ids)
def test_a_python_fragment_still_parses(block: Block) -> None:
    if block.lang == "python":
        ast.parse(block.code)


def test_compat_blocks_are_served_by_the_compat_suite() -> None:
    compat = "\n".join(p.read_text() for p in (ROOT / "tests" / "compat").glob("*.py"))
    for b in [b for b in BLOCKS if b.marker == "compat-test"]:
        assert b.page.parent.name == "integrations", b.where
        assert f'"{b.argument}"' in compat, f"{b.where}: no compat test serves {b.argument}"


def test_same_as_blocks_are_the_files_they_name() -> None:
    for b in [b for b in BLOCKS if b.marker == "same-as"]:
        assert b.argument is not None
        assert b.code in (ROOT / b.argument).read_text(), f"{b.where} differs from {b.argument}"


def test_servers_named_by_run_with_exist() -> None:
    files = {b.argument for b in BLOCKS if b.marker == "file"}
    for b in [b for b in BLOCKS if b.marker == "run-with"]:
        assert b.argument == "demo" or b.argument in files, b.where
    runs = {b.argument for b in BLOCKS if b.marker == "run-with"}
    assert files <= runs, "a file: block nobody runs"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("block", unmarked("python"), ids=ids)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    done = subprocess.run(
        [sys.executable, "-c", HARNESS, str(script)],
        cwd=tmp_path,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,  # a block that never exits fails here (an unclosed client's loop)
    )
    assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("block", unmarked("sh"), ids=ids)
def test_sh_block_runs(block: Block, tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=tmp_path,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("block", unmarked("console"), ids=ids)
def test_console_block_prints_what_it_shows(block: Block, tmp_path: Path) -> None:
    """``$ command`` lines, each followed by exactly the output the command prints."""
    sessions = re.split(r"^\$ ", block.code, flags=re.M)[1:]
    assert sessions, f"{block.where}: no $ command"
    for session in sessions:
        command, _, shown = session.partition("\n")
        done = subprocess.run(
            shlex.split(command),
            cwd=tmp_path,
            env=env_for(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.stdout == shown, f"{block.where}: {command}\n{done.stderr}"


@pytest.mark.parametrize("block", unmarked("json"), ids=ids)
def test_json_block_parses(block: Block) -> None:
    json.loads(block.code)


@pytest.mark.parametrize("block", unmarked("yaml"), ids=ids)
def test_yaml_block_parses(block: Block) -> None:
    assert yaml.safe_load(block.code) is not None
