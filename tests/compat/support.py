"""What the compat tests share: the docs' code blocks, gateway processes, the counting fake
provider, raw HTTP requests, the CLI and the ledger.

Every gateway here runs a code block of ``docs/integrations/*.md`` as it stands on the page
(:func:`snippet`), written to a directory of its own and served by uvicorn on loopback.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from spendguard.asgi.keys import hashed_key
from spendguard.engine.pricing import PriceTable
from spendguard.testing import expected_usage
from tests.support import ROOT, clean_env, die_with_parent, free_port, run_cli

DOCS = ROOT / "docs" / "integrations"
HOST = "127.0.0.1"
START_TIMEOUT = 90.0  # LiteLLM imports for ~10-20 s on a small machine
SETTLE_INTERVAL = "0.2"  # policy changes reach a gateway's embedded cache within this
# Where a process that tried to leave loopback would go: a closed port on loopback.
_NOWHERE = "http://127.0.0.1:9"


# -- the docs' code ---------------------------------------------------------------------------


def snippet(page: str, name: str) -> str:
    """The code block marked ``<!-- compat-test: NAME -->`` on ``docs/integrations/PAGE``."""
    text = (DOCS / page).read_text()
    marker = re.escape(f"<!-- compat-test: {name} -->")
    found = re.search(marker + r"\s*```[a-z]*\n(.*?)```", text, re.S)
    assert found is not None, f"{page} has no code block marked {name}"
    return found.group(1)


def write_snippet(page: str, name: str, into: Path) -> str:
    """Write the block to ``into/NAME``; the module name uvicorn imports it by."""
    into.mkdir(parents=True, exist_ok=True)
    (into / name).write_text(snippet(page, name))
    return Path(name).stem


def write_keys(into: Path, keys: Mapping[str, tuple[str, str]]) -> None:
    """The pages' ``keys.json``: the SHA-256 of each key -> [team, key id]."""
    (into / "keys.json").write_text(json.dumps({hashed_key(k): list(v) for k, v in keys.items()}))


# -- processes --------------------------------------------------------------------------------


def gateway_env(database: Path, **extra: str) -> dict[str, str]:
    """The environment of a gateway and of the CLI beside it: no ``SPENDGUARD_*`` but the
    ledger file and a short settlement interval (spendguard's defaults otherwise), and every
    proxy variable pointing at a closed loopback port, so nothing can leave the machine."""
    return clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{database}",
        SPENDGUARD_SETTLE_INTERVAL=SETTLE_INTERVAL,
        HTTP_PROXY=_NOWHERE,
        HTTPS_PROXY=_NOWHERE,
        ALL_PROXY=_NOWHERE,
        http_proxy=_NOWHERE,
        https_proxy=_NOWHERE,
        all_proxy=_NOWHERE,
        NO_PROXY=f"{HOST},localhost",
        no_proxy=f"{HOST},localhost",
        **extra,
    )


@dataclass
class Server:
    """A uvicorn process on a free loopback port; ``log`` holds its output."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the server exited:\n{self.tail()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Launch:
    """How to start one uvicorn server (:func:`serve_all` starts several at once)."""

    app: str
    cwd: Path
    env: dict[str, str]
    ready: str  # a GET path that answers (any status) once the app has started
    loop: str | None = None

    def start(self) -> Server:
        log = self.cwd / f"{self.app.replace(':', '.')}.log"
        port = free_port()
        path = os.pathsep.join([str(self.cwd), self.env.get("PYTHONPATH", str(ROOT))])
        command = [sys.executable, "-m", "uvicorn", self.app, "--host", HOST, "--port", str(port)]
        if self.loop:
            command += ["--loop", self.loop]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command,
                cwd=self.cwd,
                env={**self.env, "PYTHONPATH": path},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(),
            )
        return Server(proc, port, log)


def _answers(server: Server, path: str) -> bool:
    try:
        httpx.get(f"{server.base}{path}", timeout=2)
    except httpx.TransportError:
        return False
    return True


def serve_all(*launches: Launch, timeout: float = START_TIMEOUT) -> list[Server]:
    """Start every server at once (their imports overlap), then wait until each answers.
    One whose free port was taken before it bound it is started again on another."""
    servers = [launch.start() for launch in launches]
    deadline = time.monotonic() + timeout
    retries = 2
    try:
        for i, launch in enumerate(launches):
            while not _answers(servers[i], launch.ready):
                if servers[i].proc.poll() is not None:
                    taken = "address already in use" in servers[i].log.read_text()
                    if not taken or retries == 0:
                        raise RuntimeError(f"{launch.app} exited:\n{servers[i].tail()}")
                    retries -= 1
                    servers[i] = launch.start()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{launch.app} did not come up:\n{servers[i].tail()}")
                time.sleep(0.2)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def serve(launch: Launch) -> Server:
    (server,) = serve_all(launch)
    return server


@dataclass
class Provider:
    """The counting fake provider (:mod:`tests.compat.provider`) in its own process."""

    server: Server

    def received(self) -> dict[str, Any]:
        self.server.alive()
        answer: dict[str, Any] = httpx.get(f"{self.server.base}/_compat/received", timeout=5).json()
        return answer

    def count(self) -> int:
        """Requests that were not GETs (LiteLLM lists the models with GETs at start)."""
        return int(self.received()["posts"])

    def last(self) -> dict[str, Any]:
        """The last request that was not a GET."""
        return next(r for r in reversed(self.received()["requests"]) if r["method"] != "GET")


def start_provider(into: Path) -> Provider:
    into.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    return Provider(serve(Launch("tests.compat.provider:app", into, env, ready="/health")))


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_post(
    port: int, raw_path: str, body: object, headers: Mapping[str, str], timeout: float = 30
) -> Answer:
    """POST ``body`` (JSON) to ``raw_path`` byte for byte: no client normalises the path."""
    data = json.dumps(body).encode()
    lines = [
        f"POST {raw_path} HTTP/1.1",
        f"Host: {HOST}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        parsed[name.strip().lower()] = value.strip()
    if parsed.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return Answer(int(status_line.split()[1]), parsed, rest)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def is_spend_refusal(answer: Answer) -> bool:
    """spendguard's 429 for a spent limit, in the OpenAI or the Anthropic envelope."""
    if answer.status != 429:
        return False
    try:
        body = answer.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return False
    return error.get("code") == "spend_limit_exceeded" or (
        body.get("type") == "error" and "spend limit exceeded" in str(error.get("message"))
    )


# -- limits and the ledger --------------------------------------------------------------------


@dataclass
class Identity:
    """A team and key id as the gateway's integration names them."""

    team: str
    key_id: str
    limit: float | None = field(default=None)

    def day(self) -> tuple[str, ...]:
        return ("--team", self.team, "--api-key", self.key_id, "--period", "day")


def set_limit(
    env: dict[str, str], who: Identity, usd: float, refused: Callable[[], bool] | None = None
) -> None:
    """``spendguard policy set`` against the gateway's ledger. The gateway has it within a
    settlement interval: ``refused()`` (one request, refused or not) is asked until it agrees
    with the new limit."""
    run_cli(env, "policy", "set", *who.day(), "--limit-usd", f"{usd}")
    who.limit = usd
    time.sleep(2 * float(SETTLE_INTERVAL))
    if refused is not None:
        wait_for(lambda: refused() == (usd == 0), f"the gateway to apply ${usd}")


def wait_for(probe: Any, what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@dataclass(frozen=True)
class Charge:
    """One inference as the ledger holds it once settled."""

    model: str
    route: str
    input_tokens: int
    output_tokens: int
    usage_estimated: bool
    amount_micros: int


def charges_of(database: Path, inference_id: str) -> list[Charge]:
    """The settled records (and their charges) of one inference, read with sqlite3."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as db:
        rows = db.execute(
            "SELECT r.model, r.route, r.input_tokens, r.output_tokens, r.usage_estimated, "
            "c.amount_micros FROM spendguard_records r "
            "JOIN spendguard_charges c ON c.record_id = r.id WHERE r.inference_id = ?",
            (inference_id,),
        ).fetchall()
    return [Charge(m, r, i, o, bool(e), a) for m, r, i, o, e, a in rows]


def settled_charges(database: Path, inference_id: str) -> list[Charge]:
    """Wait for the gateway's worker to settle the inference; its charges."""
    wait_for(lambda: charges_of(database, inference_id), f"a charge of {inference_id}")
    time.sleep(3 * float(SETTLE_INTERVAL))  # a second charge, if there were one, lands too
    return charges_of(database, inference_id)


def price(model: str, upstream: dict[str, Any]) -> tuple[int, int, int]:
    """(input tokens, output tokens, micro-USD) of what the fake answered ``upstream``, at the
    shipped price of ``model``."""
    usage = expected_usage(upstream["path"], upstream["body"])
    cost = PriceTable.load().cost(model, usage)
    assert cost is not None, f"{model} has no shipped price"
    return usage.input_tokens, usage.output_tokens, int(cost)


def served_once(
    provider: Provider, before: int, send: Any, *, expect_status: int = 200
) -> tuple[Answer, dict[str, Any]]:
    """Send one request; it must reach the provider exactly once. Its answer and what the
    provider received."""
    answer: Answer = send()
    assert answer.status == expect_status, (answer.status, answer.body[:500])
    assert provider.count() == before + 1, "not one provider call"
    return answer, provider.last()
