"""The LiteLLM proxy as the compat tests run it: a ``config.yaml`` with an alias, pointed at the
fake provider, a master key and no database, and a page's code block as the gateway module."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from spendguard.engine.pricing import PriceTable

from .support import Launch, Provider, Server, gateway_env, write_snippet

PAGE = "litellm.md"
ALIAS, MODEL, EMBEDDING = "team-gpt", "gpt-4o-mini", "text-embedding-3-small"
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
    def deployment(name: str, model: str) -> dict[str, object]:
        params = {"model": f"openai/{model}", "api_base": f"{provider.server.base}/v1"}
        return {"model_name": name, "litellm_params": {**params, "api_key": "sk-fake-upstream"}}

    models = [deployment(MODEL, MODEL), deployment(ALIAS, MODEL), deployment(EMBEDDING, EMBEDDING)]
    return {"model_list": models}


def alias_prices(into: Path) -> Path:
    """The page's advice for aliases: a price entry of their own, here the shipped price of
    the model behind the alias."""
    price = PriceTable.load().lookup(MODEL)
    assert price is not None
    entry = {k: str(getattr(price, k)) for k in ("input", "output", "cached_input", "cache_write")}
    path = into / "prices.yaml"
    path.write_text(yaml.safe_dump({"models": {ALIAS: entry}}))
    return path


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
