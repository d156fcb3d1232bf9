"""Model price table: USD per 1M tokens, looked up by the model name a client sends.

spendguard ships a table of list prices (``prices.json`` next to the package, generated from
LiteLLM's price file by ``spendguard prices refresh``). An operator's own file is laid over it:
spendguard's format (JSON or YAML) or LiteLLM's ``model_prices_and_context_window.json``
(``SPENDGUARD_PRICES=litellm`` takes the one of the installed ``litellm`` package). The file
formats are in :mod:`.price_files`.

Prices are :class:`~decimal.Decimal` and never touch binary floats: a USD price per 1M tokens
is numerically the micro-USD price per token, so a charge is an exact integer sum over the
prices' common denominator, rounded up once, to whole micro-USD, at the end.

A name is priced by a rule, never by a guess. :meth:`PriceTable.match` tries, in order:

1. the exact name (case-insensitive), or an alias the table declares;
2. the name without routing prefixes (``openai/gpt-4o``, ``openrouter/anthropic/claude-...``),
   one ``/`` segment at a time;
3. the vendor form of a cloud's id (``us.anthropic.claude-sonnet-4-20250514-v1:0``: region
   group, vendor and version removed), and a fine-tuned model (``ft:gpt-4o-mini:org::id``)
   as its base's fine-tune entry;
4. a dated snapshot (``-2024-08-06``, ``-20250514``, ``@20250514``) as its undated family.

Steps 2-4 are logged once per name (a snapshot at WARNING: its price may differ from its
family's). Anything else is unknown and follows the configured unknown-model rule; no shared
prefix ever prices a name (``gpt-4o-mni`` is not ``gpt-4o``).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from ..money import MicroUSD

if TYPE_CHECKING:
    from ..usage import Usage

__all__ = ["Price", "PriceMatch", "PriceTable", "Resolution", "Tier"]

log = logging.getLogger("spendguard")

_PRICE_FIELDS: Final = ("input", "output", "cached_input", "cache_write")
_RESOLVED_MAX: Final = 1024  # names kept resolved; beyond, the memo starts over
_NOTED_MAX: Final = 1000  # names logged once each; beyond, no more lines (clients pick names)

DATE_SUFFIX: Final = re.compile(r"(?:-\d{4}-\d{2}-\d{2}|-\d{8}|@\d{8})$")
# Cloud ids put a region group and the vendor in front with dots and a version behind:
# ``us.anthropic.claude-...-v1:0``, ``amazon.nova-pro-v1:0``. Anchored on known vendors, so the
# dots in ``gpt-3.5-turbo`` or ``gpt-4.1`` are never mistaken for one.
_VENDOR_DOT_PREFIX: Final = re.compile(
    r"^(?:[a-z]{2,6}\.)?(?:anthropic|openai|amazon|meta|cohere|mistral|deepseek|ai21|writer)\."
)
_ENCODED: Final = re.compile(r"[0-9.,:|]+")
_CLOUD_VERSION: Final = re.compile(r"-v\d+(?::\d+)?$")
# OpenAI's fine-tuned ids: ``ft:<base>:<org>:<suffix>:<id>``; the table prices ``ft:<base>``.
_FINE_TUNE: Final = re.compile(r"^(ft:[^:]+):.+$")


class Resolution(StrEnum):
    """How a name found its entry (``spendguard prices show`` says it)."""

    EXACT = "exact name"
    ALIAS = "alias"
    ROUTING_PREFIX = "routing prefix removed"
    VENDOR_FORM = "cloud vendor form"
    FINE_TUNE = "fine-tune of its base"
    SNAPSHOT = "dated snapshot of its family"


# --------------------------------------------------------------------------------- prices


@dataclass(frozen=True, slots=True)
class Price:
    """List prices of one model in USD per 1M tokens (= micro-USD per token)."""

    input: Decimal
    output: Decimal
    cached_input: Decimal
    """Cache reads; equal to ``input`` for models without a cache discount."""
    cache_write: Decimal
    """Cache writes (Anthropic's 5-minute TTL price); equal to ``input`` where not billed apart."""
    tiers: tuple[Tier, ...] = ()
    """Long-context prices, by threshold ascending: a request whose prompt (input, cache reads
    and cache writes) is above a tier's threshold is billed at that tier's prices, all of it,
    as Anthropic, Google and OpenAI bill them."""
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
        previous = 0
        for tier in self.tiers:
            if not isinstance(tier, Tier):
                raise TypeError("Price.tiers must hold Tier values")
            if tier.above <= previous:
                raise ValueError("Price.tiers: thresholds must be positive and ascending")
            if tier.price.tiers:
                raise ValueError("Price.tiers: a tier's price has no tiers of its own")
            previous = tier.above
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
        *,
        tiers: Iterable[Tier] = (),
    ) -> Price:
        """Build a price from exact values; cache prices default to the input price."""
        inp = Decimal(input)
        return cls(
            input=inp,
            output=Decimal(output),
            cached_input=inp if cached_input is None else Decimal(cached_input),
            cache_write=inp if cache_write is None else Decimal(cache_write),
            tiers=tuple(tiers),
        )

    def cost(self, usage: Usage) -> MicroUSD:
        """Exact charge for ``usage`` in whole micro-USD, any fraction rounded up."""
        i, o = usage.input_tokens, usage.output_tokens
        c, w = usage.cached_input_tokens, usage.cache_write_tokens
        if (i | o | c | w) < 0:  # integers: the OR is negative iff one of them is
            # A negative count can only come from a parsing bug; charging it would credit the
            # budget, so refuse loudly instead.
            raise ValueError(f"negative token count in {usage!r}")
        price = self
        if self.tiers:
            prompt = i + c + w
            for tier in self.tiers:
                if prompt > tier.above:
                    price = tier.price
        pi, po, pc, pw = price._numerators
        return MicroUSD(-(-(pi * i + po * o + pc * c + pw * w) // price._denominator))

    def encode(self) -> str:
        """This price as one short exact string (what a record carries; see :meth:`decode`):
        ``input,output,cached_input,cache_write`` then ``|above:...`` per tier."""
        parts = [_flat_text(self)]
        parts.extend(f"{tier.above}:{_flat_text(tier.price)}" for tier in self.tiers)
        return "|".join(parts)

    @classmethod
    def decode(cls, text: str) -> Price:
        """The price :meth:`encode` wrote; ValueError for anything else."""
        # Plain decimals only: an exponent (1e999999999) would decode to a number whose exact
        # arithmetic takes a settlement pass hours.
        if not isinstance(text, str) or len(text) > 512 or _ENCODED.fullmatch(text) is None:
            raise ValueError("not an encoded price")
        head, *rest = text.split("|")
        tiers = []
        for part in rest:
            above, sep, flat = part.partition(":")
            if not sep or not above.isdigit():
                raise ValueError(f"not an encoded price tier: {part!r}")
            tiers.append(Tier(int(above), cls(*_flat_values(flat))))
        return cls(*_flat_values(head), tiers=tuple(tiers))


@dataclass(frozen=True, slots=True)
class Tier:
    """The prices of a request whose prompt is above ``above`` tokens."""

    above: int
    price: Price

    def __post_init__(self) -> None:
        if isinstance(self.above, bool) or not isinstance(self.above, int) or self.above <= 0:
            raise ValueError("Tier.above must be a positive number of tokens")


def _plain(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "0") else text


def _flat_text(price: Price) -> str:
    return ",".join(_plain(getattr(price, name)) for name in _PRICE_FIELDS)


def _flat_values(text: str) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    fields = text.split(",")
    if len(fields) != 4:
        raise ValueError(f"not an encoded price: {text!r}")
    try:
        values = [Decimal(f) for f in fields]
    except InvalidOperation as exc:
        raise ValueError(f"not an encoded price: {text!r}") from exc
    return values[0], values[1], values[2], values[3]


# ---------------------------------------------------------------------------------- table


@dataclass(frozen=True, slots=True)
class PriceMatch:
    """Which table entry prices a model name, how it was found, and where it came from."""

    entry: str
    price: Price
    from_file: bool
    """The operator's price file (or the gateway's aliases) set this entry."""
    provider: str | None = None
    how: Resolution = Resolution.EXACT
    via: str | None = None
    """The name the entry was found under, where it is not the entry (an alias, the name
    without its prefix, the snapshot's family)."""
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TableParts:
    """What a price table is made of (what :mod:`.price_files` reads from a file)."""

    prices: Mapping[str, Price]
    as_of: str | None = None
    providers: Mapping[str, str] = dataclass_field(default_factory=dict)
    aliases: Mapping[str, str] = dataclass_field(default_factory=dict)
    """Name → entry: names answered by another entry (LiteLLM's provider-prefixed entries
    answer their bare names; a file's own ``aliases``)."""
    max_output: Mapping[str, int] = dataclass_field(default_factory=dict)
    ambiguous: Mapping[str, tuple[str, ...]] = dataclass_field(default_factory=dict)
    """Bare names several differently priced entries could answer: priced by none."""


class PriceTable:
    """Immutable model → :class:`Price` table, looked up by the rules in the module docstring."""

    __slots__ = (
        "_aliases",
        "_ambiguous",
        "_from_file",
        "_looked_up",
        "_max_output",
        "_noted",
        "_prices",
        "_providers",
        "_resolved",
        "as_of",
        "user_as_of",
    )

    as_of: str
    """Date (``YYYY-MM-DD``) of the shipped prices."""
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
        aliases: Mapping[str, str] | None = None,
        max_output: Mapping[str, int] | None = None,
        ambiguous: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        normalised: dict[str, Price] = {}
        for name, price in prices.items():
            key = _key(name)
            if not key:
                raise ValueError("empty model name in price table")
            normalised[key] = price
        self._prices: Mapping[str, Price] = MappingProxyType(normalised)
        resolved_aliases: dict[str, str] = {}
        for name, target in (aliases or {}).items():
            key, entry = _key(name), _key(target)
            if key in normalised:
                continue  # an entry of its own beats an alias
            if entry not in normalised:
                raise ValueError(f"alias {name!r} names {target!r}, which has no price")
            resolved_aliases[key] = entry
        self._aliases: Mapping[str, str] = MappingProxyType(resolved_aliases)
        self._providers: Mapping[str, str] = MappingProxyType(
            {_key(name): who for name, who in (providers or {}).items()}
        )
        self._max_output: Mapping[str, int] = MappingProxyType(
            {_key(name): n for name, n in (max_output or {}).items()}
        )
        self._ambiguous: Mapping[str, tuple[str, ...]] = MappingProxyType(
            {_key(name): keys for name, keys in (ambiguous or {}).items()}
        )
        self._from_file = frozenset(_key(name) for name in from_file)
        # Names already resolved: every request prices its model two or three times. Bounded,
        # since the names come from clients.
        self._resolved: dict[str, tuple[str, Resolution, str] | None] = {}
        self._looked_up: dict[str, Price | None] = {}
        self._noted: set[str] = set()
        self.as_of = as_of
        self.user_as_of = user_as_of

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> PriceTable:
        """The shipped table, with the operator's file at ``path`` laid over it: spendguard's
        format (JSON or YAML), LiteLLM's JSON price file, or ``litellm`` for the price file of
        the installed ``litellm`` package."""
        from .price_files import read_prices, shipped_prices

        shipped = shipped_prices()
        as_of = shipped.as_of or ""
        if path is None:
            return cls.of_parts(shipped, as_of=as_of)
        return cls.of_parts(shipped, read_prices(path), as_of=as_of)

    @classmethod
    def of_parts(
        cls, base: TableParts, over: TableParts | None = None, *, as_of: str
    ) -> PriceTable:
        """A table of ``base`` with ``over``'s entries and aliases laid over it: a name
        ``over`` prices (as an entry or an alias) is priced by ``over``."""
        if over is None:
            return cls(
                base.prices,
                as_of=as_of,
                providers=base.providers,
                aliases=base.aliases,
                max_output=base.max_output,
                ambiguous=base.ambiguous,
            )
        mine = {_key(n) for n in over.prices} | {_key(n) for n in over.aliases}
        prices = {n: p for n, p in base.prices.items() if _key(n) not in mine}
        # A base snapshot priced as its family follows the family's new price: an operator who
        # prices gpt-4o-mini means the gpt-4o-mini-2024-07-18 the API answers with, too. A
        # snapshot with a price of its own (gpt-4o-2024-05-13) keeps it.
        followers: dict[str, str] = {}
        for name, price in base.prices.items():
            family = DATE_SUFFIX.sub("", name)
            if (
                family != name
                and _key(name) not in mine
                and family in over.prices
                and base.prices.get(family) == price
            ):
                followers[name] = family
                del prices[name]
        prices.update(over.prices)
        # An alias of the base whose name ``over`` prices yields; one whose target ``over``
        # replaced now follows the new price, which is what laying a file over means.
        aliases = {n: t for n, t in base.aliases.items() if _key(n) not in mine}
        aliases.update(followers)
        aliases.update(over.aliases)
        priced = {_key(k) for k in prices}
        aliases = {n: t for n, t in aliases.items() if _key(t) in priced}
        return cls(
            prices,
            as_of=as_of,
            user_as_of=over.as_of,
            providers={**base.providers, **over.providers},
            from_file=[*over.prices, *over.aliases],
            aliases=aliases,
            max_output={**base.max_output, **over.max_output},
            ambiguous={
                **{n: k for n, k in base.ambiguous.items() if _key(n) not in mine},
                **over.ambiguous,
            },
        )

    def with_aliases(self, aliases: Mapping[str, str | Price]) -> PriceTable:
        """This table plus a gateway's own model names: each priced as the model it routes to
        (a name this table resolves) or at a price of its own. An alias whose target has no
        price is left out (and logged): it is then an unknown model like any other."""
        prices = dict(self._prices)
        names = dict(self._aliases)
        from_file = set(self._from_file)
        for name, target in aliases.items():
            key = _key(name)
            if isinstance(target, Price):
                prices[key] = target
                names.pop(key, None)
            else:
                found = self.match(target)
                if found is None:
                    log.warning(
                        "spendguard: model alias %r routes to %r, which has no price: the alias "
                        "is an unknown model",
                        name,
                        target,
                    )
                    continue
                if key == found.entry:
                    continue
                prices.pop(key, None)
                names[key] = found.entry
            from_file.add(key)
        table = PriceTable(
            prices,
            as_of=self.as_of,
            user_as_of=self.user_as_of,
            providers=self._providers,
            from_file=from_file,
            aliases=names,
            max_output=self._max_output,
            ambiguous=self._ambiguous,
        )
        return table

    def match(self, model: str) -> PriceMatch | None:
        """The entry that prices ``model``, with its price, rule and origin; None if none."""
        found = self._found(model)
        if found is None:
            return None
        key, how, via = found
        return PriceMatch(
            key,
            self._prices[key],
            key in self._from_file or (how is Resolution.ALIAS and via in self._from_file),
            self._providers.get(key),
            how,
            via if via != key else None,
            self._max_output.get(key),
        )

    def resolve(self, model: str) -> str | None:
        """The table entry that prices ``model``, or None: for logs and 'priced as' answers."""
        found = self._found(model)
        return None if found is None else found[0]

    def ambiguous(self, model: str) -> tuple[str, ...]:
        """The entries a name could mean when it is ambiguous (empty otherwise)."""
        return self._ambiguous.get(_key(model), ()) if isinstance(model, str) else ()

    def lookup(self, model: str) -> Price | None:
        """The price for ``model`` (see the module docstring for the rules)."""
        try:  # every request prices its model two or three times: one dict lookup then
            return self._looked_up[model]
        except (KeyError, TypeError):
            pass
        found = self._found(model)
        price = None if found is None else self._prices[found[0]]
        if isinstance(model, str):
            looked_up = self._looked_up
            if len(looked_up) >= _RESOLVED_MAX:
                looked_up.clear()
            looked_up[model] = price
        return price

    def max_output_tokens(self, model: str) -> int | None:
        """The most output tokens the model can produce per completion, where the table knows."""
        found = self._found(model)
        return None if found is None else self._max_output.get(found[0])

    def cost(self, model: str, usage: Usage) -> MicroUSD | None:
        """Charge for ``usage`` on ``model`` in micro-USD; None when the model is not priced."""
        price = self.lookup(model)
        return None if price is None else price.cost(usage)

    def models(self) -> list[str]:
        """Every configured model name (lower case), sorted."""
        return sorted(self._prices)

    def aliases(self) -> Mapping[str, str]:
        """Every alias: name → the entry that prices it."""
        return self._aliases

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and self._found(model) is not None

    def __len__(self) -> int:
        return len(self._prices)

    def __repr__(self) -> str:
        return f"PriceTable({len(self._prices)} models, as_of={self.as_of!r})"

    # -- resolution -----------------------------------------------------------------------
    def _found(self, model: str) -> tuple[str, Resolution, str] | None:
        if not isinstance(model, str):
            return None
        resolved = self._resolved
        try:
            return resolved[model]
        except KeyError:
            pass
        found = self._resolve(model)
        if len(resolved) >= _RESOLVED_MAX:
            resolved.clear()
        resolved[model] = found
        if found is not None and found[1] is not Resolution.EXACT:
            self._note(model, found)
        return found

    def _direct(self, name: str) -> tuple[str, Resolution, str] | None:
        if name in self._prices:
            return name, Resolution.EXACT, name
        target = self._aliases.get(name)
        if target is not None:
            return target, Resolution.ALIAS, name
        return None

    def _resolve(self, model: str) -> tuple[str, Resolution, str] | None:
        name = _key(model)
        if not name:
            return None
        if (found := self._direct(name)) is not None:
            return found
        tuned = _FINE_TUNE.match(name)
        if tuned is not None and (found := self._direct(tuned.group(1))) is not None:
            return found[0], Resolution.FINE_TUNE, found[2]
        segments = name.split("/")
        for start in range(1, len(segments)):
            if (found := self._direct("/".join(segments[start:]))) is not None:
                how = Resolution.ROUTING_PREFIX if found[1] is Resolution.EXACT else found[1]
                return found[0], how, found[2]
        last = segments[-1]
        vendor = _CLOUD_VERSION.sub("", _VENDOR_DOT_PREFIX.sub("", last))
        if vendor != last and (found := self._direct(vendor)) is not None:
            return found[0], Resolution.VENDOR_FORM, found[2]
        family = DATE_SUFFIX.sub("", vendor)
        if family != vendor and (found := self._direct(family)) is not None:
            return found[0], Resolution.SNAPSHOT, found[2]
        return None

    def _note(self, model: str, found: tuple[str, Resolution, str]) -> None:
        if model in self._noted or len(self._noted) >= _NOTED_MAX:
            return
        self._noted.add(model)
        key, how, _ = found
        if how is Resolution.SNAPSHOT:
            # Snapshots of one family are not always priced alike (gpt-4o-2024-05-13 is dearer
            # than gpt-4o): say so where an operator looks.
            log.warning(
                "spendguard: model %r is not in the price table: priced as %s, its family (a "
                "dated snapshot); give it an entry in a price file if its price differs",
                model,
                key,
            )
        else:
            log.info("spendguard: model %r priced as %s (%s)", model, key, how.value)


def _key(name: str) -> str:
    return name.strip().lower()
