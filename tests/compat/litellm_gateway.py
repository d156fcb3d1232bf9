"""The LiteLLM proxy as the compat tests run it: a ``config.yaml`` with aliases (one routed to a
listed model, one with prices of its own in ``model_info``, one with two deployments priced
apart), pointed at the fake provider, a master key and no database, no price file, and a page's
code block as the gateway module."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import Any

import yaml

from spendguard.usage import Usage
from tests.support import ROOT

from .support import Launch, Provider, Server, gateway_env, write_snippet

PAGE = "litellm.md"
ALIAS, MODEL, EMBEDDING = "team-gpt", "gpt-4o-mini", "text-embedding-3-small"
CHEAP = "team-cheap"  # gpt-4o-mini at prices of its own, in model_info
MIXED = "team-mixed"  # two deployments: gpt-4o-mini at its list price, and at CHEAP's
# LiteLLM's per-token USD (as its docs write them) and, by hand, the same per 1M tokens.
CHEAP_INFO = {"input_cost_per_token": 1e-07, "output_cost_per_token": 4e-07}
CHEAP_PER_1M = {"input": Decimal("0.1"), "output": Decimal("0.4")}
MIXED_IDS = ("mixed-list", "mixed-cheap")
# Everything LiteLLM would fetch from the internet when it starts, read from its own package.
_LOCAL = (
    "LITELLM_LOCAL_MODEL_COST_MAP",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS",
    "LITELLM_LOCAL_BLOG_POSTS",
    "LITELLM_LOCAL_POLICY_TEMPLATES",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS",
)


@dataclass
class LiteLLM:
    server: Server
    master_key: str
    database: Path
    env: dict[str, str]

    @property
    def base(self) -> str:
        return self.server.base

    @property
    def port(self) -> int:
        return self.server.port

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.master_key}"}


def _config(provider: Provider) -> dict[str, object]:
    def deployment(name: str, model: str, **info: Any) -> dict[str, object]:
        params = {"model": f"openai/{model}", "api_base": f"{provider.server.base}/v1"}
        entry = {"model_name": name, "litellm_params": {**params, "api_key": "sk-fake-upstream"}}
        return {**entry, "model_info": info} if info else entry

    models = [
        deployment(MODEL, MODEL),
        deployment(ALIAS, MODEL),
        deployment(EMBEDDING, EMBEDDING),
        deployment(CHEAP, MODEL, **CHEAP_INFO),
        deployment(MIXED, MODEL, id=MIXED_IDS[0]),
        deployment(MIXED, MODEL, id=MIXED_IDS[1], **CHEAP_INFO),
    ]
    return {"model_list": models}


def shipped_per_1m(model: str) -> dict[str, Decimal]:
    """The shipped list prices of ``model`` (USD per 1M tokens), read from the JSON file itself,
    not through spendguard's price table."""
    shipped = json.loads((ROOT / "spendguard" / "prices.json").read_text())
    entry = shipped["models"][model]
    return {"input": Decimal(entry["input"]), "output": Decimal(entry["output"])}


def micro_usd(usage: Usage, per_1m: dict[str, Decimal]) -> int:
    """What ``usage`` costs at prices per 1M tokens (= micro-USD per token), rounded up once."""
    assert not usage.cached_input_tokens and not usage.cache_write_tokens  # (the fake's usage)
    exact = usage.input_tokens * per_1m["input"] + usage.output_tokens * per_1m["output"]
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


def new_master_key() -> str:
    """A master key LiteLLM accepts (it refuses to start with a publicly known one)."""
    return f"sk-compat-{secrets.token_hex(12)}"


def litellm_launch(
    into: Path, provider: Provider, block: str, master_key: str, **settings: str
) -> tuple[Launch, dict[str, str]]:
    """How to serve the page's ``block`` (LiteLLM plus spendguard) from ``into``, where the
    block's other files (``keys.json``) already are; and the environment (the CLI's too)."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.yaml").write_text(yaml.safe_dump(_config(provider)))
    upstream = provider.server.base
    env = gateway_env(
        into / "spendguard.db",
        CONFIG_FILE_PATH=str(into / "config.yaml"),
        LITELLM_MASTER_KEY=master_key,
        # The provider pass-through routes (/openai/..., /anthropic/...) go to the fake too.
        OPENAI_API_BASE=f"{upstream}/",
        OPENAI_API_KEY="sk-fake-upstream",
        ANTHROPIC_API_BASE=upstream,
        ANTHROPIC_API_KEY="sk-fake-upstream",
        LITELLM_MODEL_COST_MAP_URL="http://127.0.0.1:9/",
        LITELLM_ANTHROPIC_BETA_HEADERS_URL="http://127.0.0.1:9/",
        NO_DOCS="True",
        **dict.fromkeys(_LOCAL, "True"),
        **settings,
    )
    module = write_snippet(PAGE, block, into)
    return Launch(f"{module}:app", into, env, ready="/health/liveliness"), env


def litellm(server: Server, master_key: str, env: dict[str, str]) -> LiteLLM:
    return LiteLLM(server, master_key, server.log.parent / "spendguard.db", env)
