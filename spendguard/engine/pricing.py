"""Model price table: USD per 1M tokens, looked up by the model name a client sends.

spendguard ships a table of public list prices (``prices.json`` next to this module). An
operator's own file (JSON or YAML) is laid over it: an entry there replaces the shipped entry of
the same model and new entries extend the table. Both files use one format::

    {"as_of": "2026-06-21",
     "models": {"gpt-4o-mini": {"input": "0.15", "output": "0.60", "cached_input": "0.075"}}}

An operator's file may instead be LiteLLM's ``model_prices_and_context_window.json`` (or a copy
of part of it), which many gateways already maintain: USD *per token* in
``input_cost_per_token``, ``output_cost_per_token``, ``cache_read_input_token_cost`` and
``cache_creation_input_token_cost``, with ``litellm_provider`` and ``mode``. It is recognised by
its shape (no ``models`` key; entries with LiteLLM's fields). Entries of modes that are not
billed per text token (image generation, speech, transcription, moderation, rerank...) and
entries without token prices are skipped; the others become per-1M prices exactly (a per-token
``1.5e-07`` is ``0.15``).

Prices are parsed to :class:`~decimal.Decimal` and never touch binary floats: a USD price per
1M tokens is numerically the micro-USD price per token, so a charge is an exact sum (integers
over the prices' common denominator) that is rounded up once, to whole micro-USD, at the end.

Model names reach us in many spellings (``openai/gpt-4o-mini``, ``gpt-4o-mini-2024-07-18``,
``claude-sonnet-4@20250514``, ``us.anthropic.claude-sonnet-4-20250514-v1:0``). :meth:`lookup`
tries, in order: the exact name (case-insensitive), the name without a provider prefix, the name
without a date suffix, then the longest table entry the name starts with at a ``-`` boundary.
That last step never crosses a variant word: ``gpt-4o-audio-preview`` or
``gemini-2.5-flash-preview-tts`` bill audio, images or searches at other prices than the text
model they start with, so they match only an entry of their own (or none, and the caller's
unknown-model rule applies).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import yaml

from ..errors import ConfigurationError
from ..money import MicroUSD

if TYPE_CHECKING:
    from ..usage import Usage

__all__ = ["Price", "PriceMatch", "PriceTable"]

log = logging.getLogger("spendguard")

_SHIPPED_FILE: Final = "prices.json"
_PRICE_FIELDS: Final = ("input", "output", "cached_input", "cache_write")
_REQUIRED_PRICE_FIELDS: Final = ("input", "output")
# Not prices: who sells the model (shown by ``spendguard prices show``).
_ENTRY_FIELDS: Final = (*_PRICE_FIELDS, "provider")
_TOP_LEVEL_FIELDS: Final = ("as_of", "source", "sources", "models")

# Words that make a model a variant priced apart from the text model its name starts with
# (audio or image tokens, per-call search fees, speech, embeddings...): a name is never
# priced as a shorter entry across one of them.
_VARIANT_WORDS: Final = frozenset(
    {
        "audio",
        "realtime",
        "image",
        "images",
        "vision",
        "transcribe",
        "transcription",
        "tts",
        "speech",
        "embed",
        "embedding",
        "search",
        "deep",
        "research",
        "computer",
        "live",
        "moderation",
    }
)

# LiteLLM's price file: per-token USD fields, and the modes billed per text token.
_LITELLM_PRICE_FIELDS: Final = {
    "input_cost_per_token": "input",
    "output_cost_per_token": "output",
    "cache_read_input_token_cost": "cached_input",
    "cache_creation_input_token_cost": "cache_write",
}
_LITELLM_MODES: Final = frozenset({"chat", "completion", "responses", "embedding"})
_LITELLM_MARKERS: Final = frozenset({"litellm_provider", "input_cost_per_token", "mode"})
_PER_MILLION: Final = Decimal(1_000_000)
# No real price comes near $1 per token; a bigger value is a typo (a per-token price pasted as a
# per-1M one, a stray exponent) and would make every request unaffordable, so it is refused.
_MAX_PRICE: Final = Decimal(1_000_000)

_RESOLVED_MAX: Final = 1024  # names kept resolved; beyond, the memo starts over
_DATE_SUFFIX: Final = re.compile(r"(?:-\d{4}-\d{2}-\d{2}|-\d{8}|@\d{8})$")
# Bedrock-style ids put the vendor (and an optional region group) in front with dots:
# ``anthropic.claude-...`` / ``us.anthropic.claude-...``. Anchored and specific, so the dots in
# ``gpt-3.5-turbo`` or ``gpt-4.1`` are never mistaken for one.
_VENDOR_DOT_PREFIX: Final = re.compile(r"^(?:[a-z]{2,6}\.)?(?:anthropic|openai)\.")


@dataclass(frozen=True, slots=True)
class Price:
    """List prices of one model in USD per 1M tokens (= micro-USD per token)."""

    input: Decimal
    output: Decimal
    cached_input: Decimal
    """Cache reads; equal to ``input`` for models without a cache discount."""
    cache_write: Decimal
    """Cache writes (Anthropic's 5-minute TTL price); equal to ``input`` where not billed apart."""
    # The four prices above as integers over one common denominator, so a charge is an exact
    # integer sum divided and rounded up once: Decimal arithmetic made pricing several times
    # dearer (a settlement prices every record).
    _numerators: tuple[int, int, int, int] = dataclass_field(init=False, repr=False, compare=False)
    _denominator: int = dataclass_field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Prices built in code get the same checks as prices read from a file: a negative or
        # NaN price would silently credit budgets instead of charging them.
        for name in _PRICE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Decimal):
                raise TypeError(f"Price.{name} must be a Decimal, not {type(value).__name__}")
            if not value.is_finite() or value < 0:
                raise ValueError(f"Price.{name} must be a finite, non-negative number: {value}")
        ratios = [getattr(self, name).as_integer_ratio() for name in _PRICE_FIELDS]
        denominator = math.lcm(*(d for _, d in ratios))
        numerators = tuple(n * (denominator // d) for n, d in ratios)
        object.__setattr__(self, "_numerators", numerators)
        object.__setattr__(self, "_denominator", denominator)

    @classmethod
    def of(
        cls,
        input: Decimal | str | int,
        output: Decimal | str | int,
        cached_input: Decimal | str | int | None = None,
        cache_write: Decimal | str | int | None = None,
    ) -> Price:
        """Build a price from exact values; cache prices default to the input price."""
        inp = Decimal(input)
        return cls(
            input=inp,
            output=Decimal(output),
            cached_input=inp if cached_input is None else Decimal(cached_input),
            cache_write=inp if cache_write is None else Decimal(cache_write),
        )

    def cost(self, usage: Usage) -> MicroUSD:
        """Exact charge for ``usage`` in whole micro-USD, any fraction rounded up."""
        i, o = usage.input_tokens, usage.output_tokens
        c, w = usage.cached_input_tokens, usage.cache_write_tokens
        if (i | o | c | w) < 0:  # integers: the OR is negative iff one of them is
            # A negative count can only come from a parsing bug; charging it would credit the
            # budget, so refuse loudly instead.
            raise ValueError(f"negative token count in {usage!r}")
        pi, po, pc, pw = self._numerators
        return MicroUSD(-(-(pi * i + po * o + pc * c + pw * w) // self._denominator))


@dataclass(frozen=True, slots=True)
class PriceMatch:
    """Which table entry prices a model name, and where the entry came from."""

    entry: str
    price: Price
    from_file: bool
    """The operator's price file set this entry (else it is the shipped one)."""
    provider: str | None = None


class PriceTable:
    """Immutable model → :class:`Price` table with forgiving name lookup."""

    __slots__ = (
        "_from_file",
        "_longest",
        "_prices",
        "_providers",
        "_resolved",
        "as_of",
        "user_as_of",
    )

    as_of: str
    """Date (``YYYY-MM-DD``) the shipped prices were taken from the providers' pages."""
    user_as_of: str | None
    """The ``as_of`` of the operator's file, when it has one."""

    def __init__(
        self,
        prices: Mapping[str, Price],
        *,
        as_of: str,
        user_as_of: str | None = None,
        providers: Mapping[str, str] | None = None,
        from_file: Iterable[str] = (),
    ) -> None:
        normalised: dict[str, Price] = {}
        for name, price in prices.items():
            key = name.strip().lower()
            if not key:
                raise ValueError("empty model name in price table")
            normalised[key] = price
        self._prices: Mapping[str, Price] = MappingProxyType(normalised)
        # No entry is longer than this: the prefix search needs to look no further.
        self._longest = max(map(len, normalised), default=0)
        self._providers: Mapping[str, str] = MappingProxyType(
            {name.strip().lower(): who for name, who in (providers or {}).items()}
        )
        self._from_file = frozenset(name.strip().lower() for name in from_file)
        # Names already resolved: every request prices its model two or three times, and a
        # served name (``gpt-4o-mini-2024-07-18``) takes the regex steps below. Bounded, since
        # the names come from clients.
        self._resolved: dict[str, str | None] = {}
        self.as_of = as_of
        self.user_as_of = user_as_of

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> PriceTable:
        """The shipped table, with the operator's file at ``path`` laid over it: JSON or YAML
        in spendguard's format, or LiteLLM's JSON price file."""
        shipped = _shipped_document()
        if path is None:
            return cls(shipped.prices, as_of=shipped.as_of, providers=shipped.providers)
        user = _read_document(path)
        return cls(
            {**shipped.prices, **user.prices},
            as_of=shipped.as_of,
            user_as_of=user.as_of,
            providers={**shipped.providers, **user.providers},
            from_file=user.prices,
        )

    def match(self, model: str) -> PriceMatch | None:
        """The entry that prices ``model``, with its price and origin; None if none does."""
        key = self.resolve(model)
        if key is None:
            return None
        return PriceMatch(key, self._prices[key], key in self._from_file, self._providers.get(key))

    def resolve(self, model: str) -> str | None:
        """The table entry that prices ``model``, or None: for logs and 'priced as' answers."""
        if not isinstance(model, str):
            return None
        resolved = self._resolved
        try:
            return resolved[model]
        except KeyError:
            pass
        key = self._resolve(model)
        if len(resolved) >= _RESOLVED_MAX:
            resolved.clear()
        resolved[model] = key
        return key

    def _resolve(self, model: str) -> str | None:
        name = model.strip().lower()
        if not name:
            return None
        prices = self._prices
        if name in prices:
            return name
        # Provider prefixes: ``openai/``, ``azure/``, ``openrouter/anthropic/``...
        bare = _VENDOR_DOT_PREFIX.sub("", name.rpartition("/")[2])
        if bare in prices:
            return bare
        undated = _DATE_SUFFIX.sub("", bare)
        if undated in prices:
            return undated
        # The name's own '-'-bounded prefixes, longest first, each one dict lookup: the cost
        # depends on the longest entry, not on the table's size (LiteLLM's file has thousands).
        for end in range(min(len(undated) - 1, self._longest), 0, -1):
            if undated[end] == "-" and (key := undated[:end]) in prices:
                if _crosses_a_variant(key, undated):
                    return None  # the longest prefix is the family: no shorter one may do
                return key
        return None

    def lookup(self, model: str) -> Price | None:
        """The price for ``model`` (see the module docstring for the matching rules)."""
        key = self.resolve(model)  # memoised by name
        return None if key is None else self._prices[key]

    def cost(self, model: str, usage: Usage) -> MicroUSD | None:
        """Charge for ``usage`` on ``model`` in micro-USD; None when the model is not priced."""
        price = self.lookup(model)
        return None if price is None else price.cost(usage)

    def models(self) -> list[str]:
        """Every configured model name (lower case), sorted."""
        return sorted(self._prices)

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and self.resolve(model) is not None

    def __len__(self) -> int:
        return len(self._prices)

    def __repr__(self) -> str:
        return f"PriceTable({len(self._prices)} models, as_of={self.as_of!r})"


def _crosses_a_variant(key: str, name: str) -> bool:
    """Whether ``name``'s words past the entry ``key`` name a variant ``key`` does not."""
    own = set(key.split("-"))
    return any(word in _VARIANT_WORDS and word not in own for word in name[len(key) :].split("-"))


# ---------------------------------------------------------------------------------------------
# File parsing


@dataclass(frozen=True, slots=True)
class _Document:
    prices: Mapping[str, Price]
    as_of: str | None
    providers: Mapping[str, str] = dataclass_field(default_factory=dict)


@lru_cache(maxsize=1)
def _shipped_document() -> _ShippedDocument:
    # The shipped file never changes at run time: parse it once per process.
    resource = resources.files("spendguard").joinpath(_SHIPPED_FILE)
    label = f"spendguard/{_SHIPPED_FILE}"
    try:
        text = resource.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{label}: cannot read the shipped price table: {exc}") from exc
    document = _parse_document(_parse_json(text, label), label)
    if document.as_of is None:
        raise ConfigurationError(f"{label}: as_of: required in the shipped price table")
    return _ShippedDocument(document.prices, document.as_of, document.providers)


@dataclass(frozen=True, slots=True)
class _ShippedDocument:
    prices: Mapping[str, Price]
    as_of: str
    providers: Mapping[str, str]


def _read_document(path: str | os.PathLike[str]) -> _Document:
    label = os.fspath(path)
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigurationError(
            f"{label}: unsupported price-file extension {suffix or '(none)'!r}; "
            "use .json, .yaml or .yml"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigurationError(f"{label}: price file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{label}: cannot read price file: {exc}") from exc
    data = _parse_json(text, label) if suffix == ".json" else _parse_yaml(text, label)
    return _parse_document(data, label)


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


def _parse_document(data: Any, label: str) -> _Document:
    if _is_litellm(data):
        return _parse_litellm(data, label)
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
    prices, providers = _parse_models(models.items(), label)
    return _Document(prices=prices, as_of=as_of, providers=providers)


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
) -> tuple[dict[str, Price], dict[str, str]]:
    prices: dict[str, Price] = {}
    providers: dict[str, str] = {}
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
    return prices, providers


def _parse_price_entry(entry: Any, where: str) -> Price:
    if not isinstance(entry, Mapping):
        raise ConfigurationError(f"{where}: must be a mapping with input and output prices")
    for field in entry:
        if field not in _ENTRY_FIELDS:
            raise ConfigurationError(
                f"{where}.{field}: unknown field (allowed: {', '.join(_ENTRY_FIELDS)})"
            )
    for field in _REQUIRED_PRICE_FIELDS:
        if field not in entry:
            raise ConfigurationError(f"{where}.{field}: required")
    values: dict[str, Decimal] = {}
    for field in _PRICE_FIELDS:
        if field in entry:
            values[field] = _parse_amount(entry[field], f"{where}.{field}")
    return Price.of(**values)


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


def _parse_litellm(data: Mapping[str, Any], label: str) -> _Document:
    prices: dict[str, Price] = {}
    providers: dict[str, str] = {}
    skipped: list[str] = []
    for name, entry in data.items():
        if name == "sample_spec" or not isinstance(name, str) or not name.strip():
            continue
        key = name.strip().lower()
        mode = entry.get("mode", "chat")
        if mode not in _LITELLM_MODES or "input_cost_per_token" not in entry:
            continue  # priced per image, second, call or character, or not priced at all
        if "output_cost_per_token" not in entry and mode != "embedding":
            continue  # half a price is no price
        where = f"{label}: {name}"
        try:
            values = {
                ours: _parse_amount(entry[theirs], f"{where}.{theirs}", scale=_PER_MILLION)
                for theirs, ours in _LITELLM_PRICE_FIELDS.items()
                if entry.get(theirs) is not None
            }
        except ConfigurationError as exc:
            # One odd entry of a third-party file of thousands must not refuse them all.
            skipped.append(str(exc))
            continue
        values.setdefault("output", Decimal(0))
        if key in prices:
            continue  # the same name in another case: LiteLLM's first spelling wins
        prices[key] = Price.of(**values)
        provider = entry.get("litellm_provider")
        if isinstance(provider, str):
            providers[key] = provider
    if skipped:
        log.warning(
            "%s: %d LiteLLM entries skipped for invalid prices, e.g. %s",
            label,
            len(skipped),
            skipped[0],
        )
    return _Document(prices=prices, as_of=None, providers=providers)
