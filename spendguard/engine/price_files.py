"""Price files: spendguard's own format, and LiteLLM's ``model_prices_and_context_window.json``.

spendguard's format (JSON or YAML), USD per 1M tokens, as exact decimal strings::

    {"as_of": "2026-12-02",
     "aliases": {"team-gpt": "gpt-4o-mini"},
     "models": {"gpt-4o-mini": {"input": "0.15", "output": "0.60", "cached_input": "0.075",
                                "max_output_tokens": 16384},
                "gemini-2.5-pro": {"input": "1.25", "output": "10", "cached_input": "0.125",
                                   "tiers": [{"above": 200000, "input": "2.50", "output": "15",
                                              "cached_input": "0.25"}]}}}

LiteLLM's file is recognised by its shape (no ``models`` key; entries with LiteLLM's fields):
USD *per token* in ``input_cost_per_token``, ``output_cost_per_token``,
``cache_read_input_token_cost`` and ``cache_creation_input_token_cost``, which become per-1M
prices exactly (a per-token ``1.5e-07`` is ``0.15``), and the long-context prices
``*_above_<N>k_tokens`` as tiers. What is *not* taken from it, on purpose: the batch, flex and
priority service tiers (``*_batches``, ``*_flex``, ``*_priority``: spendguard charges the
standard tier; batches do not pass its routes), the 1-hour cache-write price, and entries not
billed per text token (images, speech, transcription, rerank, search... by ``mode``).

Its provider-prefixed entries (``xai/grok-4.3``) also answer their bare names (``grok-4.3``)
and every shorter ``/``-suffix, unless the file has an entry of that name: of the entries that
could answer a bare name, those of the model's maker (``litellm_provider`` one of
:data:`FIRST_PARTY`; not ``codestral``, Mistral's free Codestral endpoint) come first; if the
first group disagrees on the price, the name is ambiguous and priced by none of them
(``spendguard prices show`` lists them).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml

from ..errors import ConfigurationError
from .pricing import Price, TableParts, Tier

__all__ = ["FIRST_PARTY", "LITELLM", "litellm_file", "read_prices", "shipped_prices"]

log = logging.getLogger("spendguard")

LITELLM: Final = "litellm"
"""``SPENDGUARD_PRICES=litellm``: the price file of the installed ``litellm`` package."""
_LITELLM_BUNDLED: Final = "model_prices_and_context_window_backup.json"

# LiteLLM providers that are the model's own maker: their entry answers a bare name first.
FIRST_PARTY: Final = frozenset(
    {
        "openai",
        "text-completion-openai",
        "anthropic",
        "gemini",
        "vertex_ai-language-models",
        "mistral",
        "deepseek",
        "xai",
        "cohere",
        "cohere_chat",
        "meta_llama",
        "amazon_nova",
    }
)

_SHIPPED_FILE: Final = "prices.json"
_PRICE_FIELDS: Final = ("input", "output", "cached_input", "cache_write")
_REQUIRED_PRICE_FIELDS: Final = ("input", "output")
_ENTRY_FIELDS: Final = (*_PRICE_FIELDS, "provider", "max_output_tokens", "tiers")
_TIER_FIELDS: Final = ("above", *_PRICE_FIELDS)
_TOP_LEVEL_FIELDS: Final = ("as_of", "source", "sources", "aliases", "models")

_LITELLM_PRICE_FIELDS: Final = {
    "input_cost_per_token": "input",
    "output_cost_per_token": "output",
    "cache_read_input_token_cost": "cached_input",
    "cache_creation_input_token_cost": "cache_write",
}
_LITELLM_TIER_FIELD: Final = re.compile(
    r"^(input_cost_per_token|output_cost_per_token|cache_read_input_token_cost"
    r"|cache_creation_input_token_cost)_above_(\d+)k_tokens$"
)
_LITELLM_MODES: Final = frozenset({"chat", "completion", "responses", "embedding"})
_LITELLM_MARKERS: Final = frozenset({"litellm_provider", "input_cost_per_token", "mode"})
_PER_MILLION: Final = Decimal(1_000_000)
# No real price comes near $1 per token; a bigger value is a typo (a per-token price pasted as a
# per-1M one, a stray exponent) and would make every request unaffordable, so it is refused.
_MAX_PRICE: Final = Decimal(1_000_000)
_MAX_OUTPUT: Final = 100_000_000


def litellm_file() -> Path:
    """The price file bundled with the installed ``litellm`` package (found without importing
    it: importing LiteLLM takes seconds)."""
    spec = importlib.util.find_spec(LITELLM)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigurationError(
            "prices=litellm: the litellm package is not installed (pip install litellm), "
            "or give the path of a copy of its model_prices_and_context_window.json"
        )
    path = Path(locations[0]) / _LITELLM_BUNDLED
    if not path.is_file():
        raise ConfigurationError(f"prices=litellm: {path}: not found in the litellm package")
    return path


def read_prices(path: str | os.PathLike[str]) -> TableParts:
    """An operator's price file: spendguard's format (JSON or YAML) or LiteLLM's JSON; the word
    ``litellm`` reads the installed package's file."""
    if os.fspath(path) == LITELLM:
        path = litellm_file()
    label = os.fspath(path)
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigurationError(
            f"{label}: unsupported price-file extension {suffix or '(none)'!r}; "
            "use .json, .yaml or .yml (or 'litellm' for the installed LiteLLM's file)"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigurationError(f"{label}: price file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{label}: cannot read price file: {exc}") from exc
    data = _parse_json(text, label) if suffix == ".json" else _parse_yaml(text, label)
    return parse_prices(data, label)


@lru_cache(maxsize=1)
def shipped_prices() -> TableParts:
    """The shipped table (parsed once per process: it never changes at run time)."""
    resource = resources.files("spendguard").joinpath(_SHIPPED_FILE)
    label = f"spendguard/{_SHIPPED_FILE}"
    try:
        text = resource.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{label}: cannot read the shipped price table: {exc}") from exc
    parts = parse_prices(_parse_json(text, label), label)
    if parts.as_of is None:
        raise ConfigurationError(f"{label}: as_of: required in the shipped price table")
    return parts


def parse_prices(data: Any, label: str) -> TableParts:
    """A parsed document (JSON or YAML) in either format."""
    if _is_litellm(data):
        return parse_litellm(data, label)
    if not isinstance(data, Mapping):
        raise ConfigurationError(
            f"{label}: the top level must be a mapping with 'as_of' and 'models'"
        )
    for key in data:
        if key not in _TOP_LEVEL_FIELDS:
            raise ConfigurationError(
                f"{label}: {key}: unknown field (allowed: {', '.join(_TOP_LEVEL_FIELDS)})"
            )
    as_of = _parse_as_of(data.get("as_of"), label)
    source = data.get("source")
    if source is not None and not isinstance(source, str):
        raise ConfigurationError(f"{label}: source: must be a string")
    sources = data.get("sources")
    if sources is not None and not (
        isinstance(sources, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items())
    ):
        raise ConfigurationError(f"{label}: sources: must map providers to strings")
    if "models" not in data:
        raise ConfigurationError(f"{label}: models: required")
    models = data["models"]
    if not isinstance(models, Mapping):
        raise ConfigurationError(f"{label}: models: must be a mapping of model name to prices")
    prices, providers, max_output = _parse_models(models.items(), label)
    aliases = _parse_aliases(data.get("aliases", {}), prices, label)
    return TableParts(prices, as_of, providers, aliases, max_output)


def _parse_aliases(value: Any, prices: Mapping[str, Price], label: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{label}: aliases: must map model names to model names")
    aliases: dict[str, str] = {}
    for name, target in value.items():
        if not isinstance(name, str) or not name.strip() or not isinstance(target, str):
            raise ConfigurationError(f"{label}: aliases.{name!r}: must map a name to a name")
        key = name.strip().lower()
        if key in prices:
            raise ConfigurationError(f"{label}: aliases.{name}: also a model of its own")
        # An alias names an entry of this file or of the shipped table it is laid over; which
        # one is checked when the table is built, where both are known.
        aliases[key] = target.strip().lower()
    return aliases


def _parse_as_of(value: Any, label: str) -> str | None:
    if value is None:
        return None
    # YAML reads an unquoted 2026-06-21 as a date; accept it (but not a datetime).
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        try:
            dt.date.fromisoformat(value)
        except ValueError:
            pass
        else:
            return value
    raise ConfigurationError(f"{label}: as_of: must be a date written YYYY-MM-DD")


def _parse_models(
    items: Iterable[tuple[Any, Any]], label: str
) -> tuple[dict[str, Price], dict[str, str], dict[str, int]]:
    prices: dict[str, Price] = {}
    providers: dict[str, str] = {}
    max_output: dict[str, int] = {}
    spelled: dict[str, str] = {}
    for name, entry in items:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f"{label}: models.{name!r}: model name must be a string")
        where = f"{label}: models.{name}"
        key = name.strip().lower()
        if key in spelled:
            # Lookup is case-insensitive, so "GPT-4o" and "gpt-4o" would fight over one entry.
            raise ConfigurationError(
                f"{where}: same model as models.{spelled[key]} (names are case-insensitive)"
            )
        spelled[key] = name
        prices[key] = _parse_price_entry(entry, where)
        provider = entry.get("provider")
        if provider is not None:
            if not isinstance(provider, str):
                raise ConfigurationError(f"{where}.provider: must be a string")
            providers[key] = provider
        if "max_output_tokens" in entry:
            max_output[key] = _parse_count(entry["max_output_tokens"], f"{where}.max_output_tokens")
    return prices, providers, max_output


def _parse_count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_OUTPUT:
        raise ConfigurationError(f"{where}: must be a whole number of tokens above 0")
    return value


def _known_fields(entry: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for field in entry:
        if field not in allowed:
            raise ConfigurationError(
                f"{where}.{field}: unknown field (allowed: {', '.join(allowed)})"
            )


def _parse_price_entry(entry: Any, where: str) -> Price:
    if not isinstance(entry, Mapping):
        raise ConfigurationError(f"{where}: must be a mapping with input and output prices")
    _known_fields(entry, _ENTRY_FIELDS, where)
    values = _flat_prices(entry, where)
    tiers = entry.get("tiers", [])
    if not isinstance(tiers, list):
        raise ConfigurationError(f"{where}.tiers: must be a list")
    parsed: list[Tier] = []
    for n, tier in enumerate(tiers):
        at = f"{where}.tiers[{n}]"
        if not isinstance(tier, Mapping):
            raise ConfigurationError(f"{at}: must be a mapping with above, input and output")
        _known_fields(tier, _TIER_FIELDS, at)
        if "above" not in tier:
            raise ConfigurationError(f"{at}.above: required")
        above = _parse_count(tier["above"], f"{at}.above")
        if parsed and above <= parsed[-1].above:
            raise ConfigurationError(f"{at}.above: tiers must be in ascending order")
        parsed.append(Tier(above, _price_of(_flat_prices(tier, at))))
    return _price_of(values, parsed)


def _price_of(values: Mapping[str, Decimal], tiers: Iterable[Tier] = ()) -> Price:
    return Price.of(
        values["input"],
        values["output"],
        values.get("cached_input"),
        values.get("cache_write"),
        tiers=tiers,
    )


def _flat_prices(entry: Mapping[str, Any], where: str) -> dict[str, Decimal]:
    for field in _REQUIRED_PRICE_FIELDS:
        if field not in entry:
            raise ConfigurationError(f"{where}.{field}: required")
    return {
        field: _parse_amount(entry[field], f"{where}.{field}")
        for field in _PRICE_FIELDS
        if field in entry
    }


def _parse_amount(value: Any, where: str, *, scale: Decimal = Decimal(1)) -> Decimal:
    """A non-negative price, exact, times ``scale`` (a per-token price to a per-1M one)."""
    amount: Decimal | None = None
    # bool is an int subclass: `input: true` is a mistake, not a price of 1.
    if isinstance(value, Decimal):
        amount = value
    elif isinstance(value, int) and not isinstance(value, bool):
        amount = Decimal(value)
    elif isinstance(value, float):
        # YAML numbers arrive as floats; their repr is the shortest that round-trips, so 0.1
        # stays 0.1 rather than 0.1000000000000000055511151231257827.
        amount = Decimal(repr(value))
    elif isinstance(value, str):
        try:
            amount = Decimal(value.strip())
        except InvalidOperation:
            amount = None
    if amount is None or not amount.is_finite() or amount < 0:
        raise ConfigurationError(f"{where}: must be a non-negative number")
    # Exact: a Decimal product carries every digit (up to the context's 28, far more than any
    # price has), so 1.5e-07 per token is exactly 0.15 per 1M.
    amount = amount * scale
    if amount > _MAX_PRICE:
        raise ConfigurationError(
            f"{where}: {amount} USD per 1M tokens is implausible (more than {_MAX_PRICE})"
        )
    # "-0" passes the sign check; store it as plain 0 so it never shows up as "-0" anywhere.
    return amount if amount else Decimal(0)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            # json would silently keep the last one; a duplicated model is an editing mistake.
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _parse_json(text: str, label: str) -> Any:
    try:
        # parse_float=Decimal keeps "0.1" exactly 0.1. NaN/Infinity literals stay floats and
        # are rejected by the field check, which names the field.
        return json.loads(text, parse_float=Decimal, object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as exc:
        raise ConfigurationError(f"{label}: duplicate key {exc.key!r}") from exc
    except ValueError as exc:
        raise ConfigurationError(f"{label}: invalid JSON: {exc}") from exc


def _parse_yaml(text: str, label: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"{label}: invalid YAML: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# LiteLLM's price file


def _is_litellm(data: Any) -> bool:
    """LiteLLM's shape: no ``models`` key, and entries carrying LiteLLM's own fields."""
    if not isinstance(data, Mapping) or not data or "models" in data:
        return False
    entries = [v for k, v in data.items() if k != "sample_spec"]
    return all(isinstance(v, Mapping) for v in data.values()) and any(
        _LITELLM_MARKERS.intersection(v) for v in entries
    )


def litellm_price(entry: Mapping[str, Any], where: str) -> Price | None:
    """One LiteLLM entry's per-text-token price (tiers included); None where it has none."""
    mode = entry.get("mode", "chat")
    if mode not in _LITELLM_MODES or entry.get("input_cost_per_token") is None:
        return None  # priced per image, second, call or character, or not priced at all
    if entry.get("output_cost_per_token") is None and mode != "embedding":
        return None  # half a price is no price
    values = {
        ours: _parse_amount(entry[theirs], f"{where}.{theirs}", scale=_PER_MILLION)
        for theirs, ours in _LITELLM_PRICE_FIELDS.items()
        if entry.get(theirs) is not None
    }
    values.setdefault("output", Decimal(0))
    above: dict[int, dict[str, Decimal]] = {}
    for field, value in entry.items():
        tier = _LITELLM_TIER_FIELD.match(field)
        if tier is None or value is None:
            continue
        ours = _LITELLM_PRICE_FIELDS[tier.group(1)]
        amount = _parse_amount(value, f"{where}.{field}", scale=_PER_MILLION)
        above.setdefault(int(tier.group(2)) * 1000, {})[ours] = amount
    tiers = []
    for threshold in sorted(above):
        # A tier names only the prices that change; the others stay the base's.
        tiers.append(Tier(threshold, _price_of(values | above[threshold])))
    return _price_of(values, tiers)


def parse_litellm(data: Mapping[str, Any], label: str) -> TableParts:
    prices: dict[str, Price] = {}
    providers: dict[str, str] = {}
    max_output: dict[str, int] = {}
    skipped: list[str] = []
    for name, entry in data.items():
        if name == "sample_spec" or not isinstance(name, str) or not name.strip():
            continue
        key = name.strip().lower()
        if key in prices:
            continue  # the same name in another case: LiteLLM's first spelling wins
        try:
            price = litellm_price(entry, f"{label}: {name}")
        except ConfigurationError as exc:
            # One odd entry of a third-party file of thousands must not refuse them all.
            skipped.append(str(exc))
            continue
        if price is None:
            continue
        prices[key] = price
        provider = entry.get("litellm_provider")
        if isinstance(provider, str):
            providers[key] = provider
        most = entry.get("max_output_tokens")
        if isinstance(most, int) and not isinstance(most, bool) and 0 < most <= _MAX_OUTPUT:
            max_output[key] = most
    if skipped:
        log.warning(
            "%s: %d LiteLLM entries skipped for invalid prices, e.g. %s",
            label,
            len(skipped),
            skipped[0],
        )
    aliases, ambiguous = bare_names(prices, providers)
    return TableParts(prices, None, providers, aliases, max_output, ambiguous)


def bare_names(
    prices: Mapping[str, Price], providers: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The names provider-prefixed entries answer (see the module docstring for the rule):
    name → entry, and the ambiguous names → the entries that disagree."""
    candidates: dict[str, list[str]] = {}
    for key in prices:
        segments = key.split("/")
        for start in range(1, len(segments)):
            suffix = "/".join(segments[start:])
            if suffix and suffix not in prices:
                candidates.setdefault(suffix, []).append(key)
    aliases: dict[str, str] = {}
    ambiguous: dict[str, tuple[str, ...]] = {}
    for name, keys in candidates.items():
        makers = [k for k in keys if providers.get(k) in FIRST_PARTY]
        group = makers or keys
        if len({prices[k] for k in group}) == 1:
            aliases[name] = group[0]
        else:
            ambiguous[name] = tuple(sorted(group))
    return aliases, ambiguous
