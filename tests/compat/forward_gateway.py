"""openai-forward as the compat tests run it: the page's code block, ``FORWARD_CONFIG`` pointed
at the fake provider, two keys (one at $0, one at a limit) in the page's ``keys.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.support import run_cli

from .support import Identity, Launch, Provider, Server, gateway_env, write_keys, write_snippet

ZERO_KEY, OPEN_KEY = "sk-client-at-zero", "sk-client-at-a-limit"
ZERO, OPEN = Identity("acme", "zero"), Identity("acme", "open")
OPEN_LIMIT_USD = 100


@dataclass
class Gateway:
    server: Server
    env: dict[str, str]
    database: Path

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def base(self) -> str:
        return self.server.base


def prepare(
    into: Path, page: str, limits: Mapping[str, tuple[Identity, str]] | None = None, **settings: str
) -> tuple[Launch, dict[str, str]]:
    """The page's block and keys.json in ``into``, and the day limit of each key (by default
    :data:`ZERO_KEY` at $0 and :data:`OPEN_KEY` at $100) in its ledger, set with the CLI before
    the gateway starts, so it reads them when it starts."""
    into.mkdir(parents=True, exist_ok=True)
    if limits is None:
        limits = {ZERO_KEY: (ZERO, "0"), OPEN_KEY: (OPEN, str(OPEN_LIMIT_USD))}
    write_keys(into, {key: (who.team, who.key_id) for key, (who, _) in limits.items()})
    env = gateway_env(into / "spendguard.db", **settings)
    for who, usd in limits.values():
        run_cli(env, "policy", "set", *who.day(), "--limit-usd", usd)
    module = write_snippet(page, "gateway.py", into)
    return Launch(f"{module}:app", into, env, ready="/healthz"), env


def forward_config(provider: Provider) -> str:
    return json.dumps([{"base_url": provider.server.base, "route": "/", "type": "openai"}])
