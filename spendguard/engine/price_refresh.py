"""The shipped price table, made from LiteLLM's price file (``spendguard prices refresh``).

LiteLLM keeps the most complete public price list (``model_prices_and_context_window.json``);
spendguard's shipped table is its chat, responses, completion and embedding entries of the
models' makers (OpenAI, Anthropic, Google, Mistral, DeepSeek, xAI, Cohere, Meta's own API), of
Amazon's models on Bedrock, and of Groq and Together (where most Llama traffic goes), under the
names clients send: ``grok-4.3`` for LiteLLM's ``xai/grok-4.3``. Each name is priced exactly as
LiteLLM's file prices it when laid over spendguard (the same rules: an entry of the name itself
first, then the maker's prefixed entry), so the shipped table and ``SPENDGUARD_PRICES=litellm``
agree on every name the table has. A few hand-kept entries (the ``default`` price, models
LiteLLM lacks) come from :data:`SUPPLEMENT` and never override LiteLLM.

Maintainers run it against the newest LiteLLM release and commit the output::

    pip download --no-deps litellm && unzip -o litellm-*.whl 'litellm/model_prices_*'
    spendguard prices refresh --from litellm/model_prices_and_context_window_backup.json \\
        --source-version "$(ls litellm-*.whl | cut -d- -f2)" --out spendguard/prices.json
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

from .price_files import FIRST_PARTY, parse_litellm
from .pricing import DATE_SUFFIX, Price, PriceTable

__all__ = ["SUPPLEMENT", "SUPPLEMENT_ALIASES", "shipped_document"]

# Hosts whose whole catalogue is shipped (open models, Llama above all, as they sell them).
_HOSTS: Final = frozenset({"groq", "together_ai"})
_AMAZON: Final = re.compile(r"^(?:[a-z]{2,6}\.)?amazon\.")
_AMAZON_PROVIDERS: Final = frozenset({"bedrock", "bedrock_converse"})
_MODES: Final = frozenset({"chat", "responses", "completion", "embedding"})
# LiteLLM's own name prefixes of the entries above (``xai/grok-4.3``): the name a client sends
# is the rest.
_PREFIXES: Final = frozenset(
    {
        "openai",
        "anthropic",
        "gemini",
        "mistral",
        "codestral",
        "text-completion-codestral",
        "deepseek",
        "xai",
        "cohere",
        "cohere_chat",
        "meta_llama",
        "groq",
        "together_ai",
    }
)

# Who sells a model, by LiteLLM's provider: the ``provider`` of a shipped entry and the keys of
# its ``sources``.
_SELLERS: Final = {
    "openai": "openai",
    "text-completion-openai": "openai",
    "anthropic": "anthropic",
    "gemini": "google",
    "vertex_ai-language-models": "google",
    "vertex_ai-embedding-models": "google",
    "mistral": "mistral",
    "deepseek": "deepseek",
    "xai": "xai",
    "cohere": "cohere",
    "cohere_chat": "cohere",
    "meta_llama": "meta",
    "groq": "groq",
    "together_ai": "together",
    "bedrock": "amazon",
    "bedrock_converse": "amazon",
}

_SOURCE: Final = (
    "USD per 1M tokens, from LiteLLM's model_prices_and_context_window.json ({version}): its "
    "chat, responses, completion and embedding entries of the providers in 'sources', under the "
    "names clients send (LiteLLM's provider prefix removed), by `spendguard prices refresh`. "
    "cached_input is the cache-read price, cache_write the 5-minute cache-write price; 'tiers' "
    "are long-context prices (a prompt above 'above' tokens is billed at them, all of it); "
    "max_output_tokens is the most a completion can produce. Not modelled: batch, flex and "
    "priority service tiers, 1-hour cache writes, audio/image tokens, search and tool fees. "
    "'default' prices unknown models under SPENDGUARD_UNKNOWN_MODEL=default_price: deliberately "
    "dear. Prices change: check them, and lay your own file over this one (SPENDGUARD_PRICES)."
)
_SOURCES: Final = {
    "openai": "LiteLLM litellm_provider openai (platform.openai.com/docs/pricing).",
    "anthropic": "LiteLLM litellm_provider anthropic (docs.anthropic.com pricing).",
    "google": "LiteLLM litellm_provider gemini and vertex_ai-language-models "
    "(ai.google.dev/gemini-api/docs/pricing); a bare name of both is priced by its own entry.",
    "mistral": "LiteLLM litellm_provider mistral and codestral (mistral.ai/pricing).",
    "deepseek": "LiteLLM litellm_provider deepseek (api-docs.deepseek.com pricing).",
    "xai": "LiteLLM litellm_provider xai (docs.x.ai/docs/models).",
    "cohere": "LiteLLM litellm_provider cohere and cohere_chat (cohere.com/pricing).",
    "meta": "Meta's own Llama API (LiteLLM meta_llama).",
    "groq": "Llama and other open models as Groq sells them (LiteLLM groq, and hand-kept "
    "entries for its Llama names: groq.com/pricing).",
    "together": "Llama and other open models as Together sells them (LiteLLM together_ai; "
    "its own model names, such as meta-llama/Llama-3.3-70B-Instruct-Turbo).",
    "amazon": "Amazon's models on Bedrock (LiteLLM bedrock, bedrock_converse: amazon.*).",
    "spendguard": "The default entry (see SUPPLEMENT in spendguard/engine/price_refresh.py, "
    "which also keeps the few entries LiteLLM's file lacks).",
}

_ANTHROPIC_SONNET: Final = {
    "input": "3",
    "output": "15",
    "cached_input": "0.30",
    "cache_write": "3.75",
    "provider": "anthropic",
}
_ANTHROPIC_OPUS: Final = {
    "input": "15",
    "output": "75",
    "cached_input": "1.50",
    "cache_write": "18.75",
    "provider": "anthropic",
}
SUPPLEMENT: Final[Mapping[str, Mapping[str, Any]]] = {
    # Deliberately dear (an Opus-class price): an unknown model must not look cheap.
    "default": {
        "input": "15",
        "output": "75",
        "cached_input": "1.5",
        "cache_write": "18.75",
        "provider": "spendguard",
    },
    # Groq's list prices (groq.com/pricing) for the Llama names its API serves, which many
    # gateways forward; LiteLLM's file no longer lists them.
    "llama-3.3-70b-versatile": {"input": "0.59", "output": "0.79", "provider": "groq"},
    "llama-3.1-8b-instant": {"input": "0.05", "output": "0.08", "provider": "groq"},
    # Anthropic's list prices (docs.anthropic.com) for models LiteLLM's file dropped that
    # Bedrock and Vertex AI still serve and gateways still route to.
    "claude-sonnet-4": _ANTHROPIC_SONNET,
    "claude-3-7-sonnet": _ANTHROPIC_SONNET,
    "claude-opus-4": _ANTHROPIC_OPUS,
    "claude-opus-4-1": _ANTHROPIC_OPUS,
    "claude-3-5-haiku": {
        "input": "0.80",
        "output": "4",
        "cached_input": "0.08",
        "cache_write": "1",
        "provider": "anthropic",
    },
    "claude-3-haiku": {
        "input": "0.25",
        "output": "1.25",
        "cached_input": "0.03",
        "cache_write": "0.30",
        "provider": "anthropic",
    },
}
# Every seller above has a line in the table's ``sources``.
SUPPLEMENT_ALIASES: Final[Mapping[str, str]] = {
    # The API's own names for the entries above.
    "claude-sonnet-4-20250514": "claude-sonnet-4",
    "claude-sonnet-4-0": "claude-sonnet-4",
    "claude-3-7-sonnet-20250219": "claude-3-7-sonnet",
    "claude-3-7-sonnet-latest": "claude-3-7-sonnet",
    "claude-opus-4-20250514": "claude-opus-4",
    "claude-opus-4-0": "claude-opus-4",
    "claude-opus-4-1-20250805": "claude-opus-4-1",
    "claude-3-5-haiku-20241022": "claude-3-5-haiku",
    "claude-3-5-haiku-latest": "claude-3-5-haiku",
    "claude-3-haiku-20240307": "claude-3-haiku",
    # What OpenAI's API answers for text-embedding-ada-002.
    "text-embedding-ada-002-v2": "text-embedding-ada-002",
}


def _selected(key: str, entry: Mapping[str, Any]) -> str | None:
    """The name a client sends for a shipped LiteLLM entry, or None if it is not shipped."""
    provider = entry.get("litellm_provider")
    if entry.get("mode", "chat") not in _MODES or not isinstance(provider, str):
        return None
    if provider in _AMAZON_PROVIDERS:
        return key if _AMAZON.match(key) and "/" not in key else None
    if provider not in FIRST_PARTY and provider not in _HOSTS:
        return None
    head, sep, rest = key.partition("/")
    if not sep:
        return key
    return rest if head in _PREFIXES and rest else None


def shipped_document(
    data: Mapping[str, Any], *, as_of: str, version: str
) -> tuple[dict[str, Any], list[str]]:
    """The shipped price file for LiteLLM's file ``data`` (parsed JSON), and the names left out
    because LiteLLM's entries disagree on them (ambiguous)."""
    parts = parse_litellm(data, "LiteLLM")
    table = PriceTable.of_parts(parts, as_of=as_of)
    names: dict[str, str] = {}
    for key, entry in data.items():
        if key == "sample_spec" or not isinstance(entry, Mapping):
            continue
        name = _selected(key, entry)
        if name is not None and key.strip().lower() in parts.prices:
            names.setdefault(name.strip().lower(), key)
    models: dict[str, Any] = {}
    left_out: list[str] = []
    for name in sorted(names):
        key = names[name].strip().lower()
        if parts.providers.get(key) in FIRST_PARTY:
            # A maker's name: priced as LiteLLM's file prices it laid over spendguard.
            found = table.match(name)
            if found is None:
                left_out.append(name)
                continue
            models[name] = _entry(found.price, found.provider, found.max_output_tokens)
        else:
            # A host's or a cloud's own name for a model it sells: its own entry.
            price, provider = parts.prices[key], parts.providers.get(key)
            models[name] = _entry(price, provider, parts.max_output.get(key))
    for name, entry in SUPPLEMENT.items():
        models.setdefault(name, dict(entry))
    sellers = {entry.get("provider") for entry in models.values()}
    document = {
        "as_of": as_of,
        "source": _SOURCE.format(version=f"LiteLLM {version}"),
        "sources": {k: v for k, v in _SOURCES.items() if k in sellers},
        "aliases": _aliases(models),
        "models": dict(sorted(models.items())),
    }
    return document, left_out


def _aliases(models: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    aliases = _families(models)
    for name, target in SUPPLEMENT_ALIASES.items():
        if name not in models and target in models:
            aliases.setdefault(name, target)
    return dict(sorted(aliases.items()))


def _families(models: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Family names for dated snapshots (``claude-sonnet-4`` for ``claude-sonnet-4-20250514``)
    where the table has none: each names its newest snapshot, and only when every snapshot of
    the family is priced alike, so a snapshot missing from the table (priced as its family by
    the snapshot rule) gets the one price the family has, never a pick among several."""
    snapshots: dict[str, list[str]] = {}
    for name in models:
        family = DATE_SUFFIX.sub("", name)
        if family != name and family not in models:
            snapshots.setdefault(family, []).append(name)
    families: dict[str, str] = {}
    for family, names in sorted(snapshots.items()):
        if _same_prices(models, names):
            families[family] = max(names, key=lambda n: re.sub(r"\D", "", n[len(family) :]))
    return families


def _same_prices(models: Mapping[str, Mapping[str, Any]], names: list[str]) -> bool:
    fields = ("input", "output", "cached_input", "cache_write", "tiers")
    return len({json.dumps([models[n].get(f) for f in fields]) for n in names}) == 1


def _entry(price: Price, provider: str | None, max_output: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = _flat(price)
    if price.tiers:
        entry["tiers"] = [{"above": tier.above, **_flat(tier.price)} for tier in price.tiers]
    if provider is not None:
        entry["provider"] = _SELLERS.get(provider, provider)
    if max_output is not None:
        entry["max_output_tokens"] = max_output
    return entry


def _flat(price: Price) -> dict[str, Any]:
    flat = {"input": _text(price.input), "output": _text(price.output)}
    # Cache prices equal to the input price are what the table assumes without them.
    if price.cached_input != price.input:
        flat["cached_input"] = _text(price.cached_input)
    if price.cache_write != price.input:
        flat["cache_write"] = _text(price.cache_write)
    return flat


def _text(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "0") else text
