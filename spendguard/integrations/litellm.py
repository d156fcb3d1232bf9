"""The LiteLLM proxy: its ``model_list`` prices the names clients send, and the response header
``x-litellm-model-id`` names the deployment that served each inference.

When the app the middleware wraps is LiteLLM's (``litellm.proxy.proxy_server:app``, found among
the modules already loaded: litellm is never imported here), the middleware reads the router's
``model_list`` once the app's startup is done, and again when it changes (a deployment added
through LiteLLM's API or database), checked at most every :data:`RESYNC_SECONDS`.

A ``model_name`` (LiteLLM's alias, the name clients send) is priced as its deployment's
``litellm_params.model``, as the price table resolves it (``openai/gpt-4o-mini`` is
``gpt-4o-mini``), or, where it has no entry, as its ``model_info.base_model``. A deployment
that states its own prices (``input_cost_per_token``, ``output_cost_per_token``,
``cache_read_input_token_cost``, ``cache_creation_input_token_cost``, in ``litellm_params`` or
else ``model_info``, as LiteLLM reads them) is priced at them: per-token USD become per-1M
prices exactly (the float's shortest repr, times 10^6, in decimal), and a cache price it leaves
out is its model's, as LiteLLM bills it. A ``model_name`` whose deployments cost differently is
held at the dearest of each price; the inference is then charged as the deployment that served
it, under a name of one price: the table's entry for a model the table prices, else the
``model_name``, else ``<model_name>@<model_info.id>``.

What is not taken from LiteLLM, on purpose: the cost headers (``x-litellm-response-cost``), a
float LiteLLM computes from its own price map after its own margins and discounts, where a
charge must be an exact number of micro-USD from one table; wildcard deployments
(``openai/*``), which serve the model the client names; and long-context tiers in
``model_info`` (the flat prices are charged). A name the operator's price file prices
(``SPENDGUARD_PRICES``) keeps the file's price.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from types import ModuleType
from typing import Any, Final

from ..engine.pricing import Price, PriceTable, Resolution

__all__ = [
    "MODEL_ID_HEADER",
    "PROXY_MODULE",
    "RESYNC_SECONDS",
    "LiteLLMRouting",
    "RouterPrices",
    "litellm_routing",
    "router_prices",
]

log = logging.getLogger("spendguard")

PROXY_MODULE: Final = "litellm.proxy.proxy_server"
MODEL_ID_HEADER: Final = b"x-litellm-model-id"
RESYNC_SECONDS: Final = 10.0
_RETRY_SECONDS: Final = 1.0  # an unknown deployment id pulls the next read this close
_PER_MILLION: Final = Decimal(1_000_000)
# LiteLLM's per-token price fields, in the order of Price.of's arguments.
_COSTS: Final = (
    "input_cost_per_token",
    "output_cost_per_token",
    "cache_read_input_token_cost",
    "cache_creation_input_token_cost",
)
_LOGGED_NAMES: Final = 20  # names spelled out in the line that reports a model_list
_WARNED_MAX: Final = 1000


@dataclass(frozen=True, slots=True)
class RouterPrices:
    """What a ``model_list`` adds to a price table."""

    aliases: Mapping[str, str | Price]
    """For :meth:`PriceTable.with_aliases`: each name clients send, and each deployment's own
    name where it needs one."""
    routed: Mapping[str, str]
    """Deployment id (``model_info.id``) -> the name its inferences are charged under."""
    unpriced: tuple[str, ...] = ()
    """``model_name``\\s left to the unknown-model rule: a deployment of theirs has no price."""


@dataclass(frozen=True, slots=True)
class _Deployment:
    alias: str
    target: str
    id: str | None
    price: Price | None  # None: neither its own prices nor a table entry
    ref: str | Price | None  # a name the table resolves, or its own price
    entry: str | None  # the table's entry that prices it (no prices of its own)


def router_prices(
    table: PriceTable,
    model_list: Iterable[Any],
    group_aliases: Mapping[str, Any] | None = None,
) -> RouterPrices:
    """The names a LiteLLM ``model_list`` (and the router's ``model_group_alias``) adds to
    ``table``, and the name each deployment is charged under (see the module docstring)."""
    deployments = [d for item in model_list if (d := _deployment(item, table)) is not None]
    groups: dict[str, list[_Deployment]] = {}
    for d in deployments:
        groups.setdefault(_key(d.alias), []).append(d)
    claimed: dict[str, Price] = {}  # name -> the one price this gateway gives it
    aliases: dict[str, str | Price] = {}
    unpriced: list[str] = []
    # The names clients send first: they are what admission prices.
    for key, members in groups.items():
        name = members[0].alias
        found = table.match(name)
        if found is not None and found.from_file and found.how in _OWN_ENTRY:
            claimed[key] = found.price  # the operator's price file names it: the file's price
            continue
        prices = _distinct(d.price for d in members)
        if None in prices or not prices:
            unpriced.append(name)
            continue
        priced = [p for p in prices if p is not None]
        if len(priced) == 1:
            ref = members[0].ref
            assert ref is not None
            claimed[key] = priced[0]
        else:  # held at the dearest; charged as the deployment that served it
            ref = claimed[key] = _dearest(priced)
        aliases[name] = ref
    for name, group in (group_aliases or {}).items():
        target = group.get("model") if isinstance(group, Mapping) else group
        if not isinstance(name, str) or not isinstance(target, str) or _key(name) in claimed:
            continue
        if (price := claimed.get(_key(target))) is not None:
            claimed[_key(name)] = price
            aliases[name] = _ref_of(aliases, target) or target
    routed: dict[str, str] = {}
    for d in deployments:
        if d.price is None or d.id is None:
            continue
        own = f"{d.alias}@{d.id}"
        for name in (d.entry or "", d.alias, own):
            if not name:
                continue
            have = claimed.get(_key(name))
            if have is None and name == d.alias:
                continue  # a model_name left unpriced stays so
            if have is not None and have != d.price:
                continue  # the name means another price on this gateway
            if have is None:
                claimed[_key(name)] = d.price
                if name == own:
                    aliases[own] = d.price
            routed[d.id] = name
            break
    # A name that now means another model must not take along the names that resolve through
    # it: those are given their price itself. So is a name that is an entry of the table (its
    # table's own aliases may lead to it).
    changed = {
        _key(n) for n, r in aliases.items() if isinstance(r, Price) or table.resolve(r) != _key(n)
    }
    for name, ref in list(aliases.items()):
        if not isinstance(ref, str) or table.resolve(ref) == _key(name):
            continue
        entry = table.match(name)
        is_entry = entry is not None and entry.how is Resolution.EXACT
        if is_entry or table.resolve(ref) in changed:
            found = table.match(ref)
            assert found is not None
            aliases[name] = found.price
    return RouterPrices(aliases, routed, tuple(unpriced))


_OWN_ENTRY: Final = (Resolution.EXACT, Resolution.ALIAS)


def _ref_of(aliases: Mapping[str, str | Price], name: str) -> str | Price | None:
    key = _key(name)
    return next((r for n, r in aliases.items() if _key(n) == key), None)


def _deployment(item: Any, table: PriceTable) -> _Deployment | None:
    if not isinstance(item, Mapping):
        return None
    params = item.get("litellm_params")
    info = item.get("model_info")
    params = params if isinstance(params, Mapping) else {}
    info = info if isinstance(info, Mapping) else {}
    alias, target = item.get("model_name"), params.get("model")
    if not isinstance(alias, str) or not alias.strip() or "*" in alias:
        return None  # a wildcard serves the model the client names: the table prices that
    if not isinstance(target, str) or not target.strip() or "*" in target:
        return None
    ident = info.get("id")
    ident = str(ident) if isinstance(ident, (str, int)) and not isinstance(ident, bool) else None
    found = table.match(target)
    ref: str | None = target
    if found is None:
        base = info.get("base_model") or params.get("base_model")
        if isinstance(base, str) and base:
            found, ref = table.match(base), base
    try:
        own = _own_price(params, info, None if found is None else found.price)
    except ValueError as exc:
        _warn(
            f"invalid:{alias}:{target}",
            "spendguard: LiteLLM deployment %r (%s) has an unusable price (%s): it has no price",
            alias,
            target,
            exc,
        )
        return _Deployment(alias, target, ident, None, None, None)
    if own is not None:
        return _Deployment(alias, target, ident, own, own, None)
    if found is None:
        return _Deployment(alias, target, ident, None, None, None)
    return _Deployment(alias, target, ident, found.price, ref, found.entry)


def _own_price(
    params: Mapping[str, Any], info: Mapping[str, Any], model: Price | None
) -> Price | None:
    """A deployment's own per-token prices, as LiteLLM reads them (``litellm_params`` first);
    None when it states no input price."""
    values: list[Decimal | None] = []
    for field in _COSTS:
        value = params.get(field)
        if value is None:
            value = info.get(field)
        values.append(None if value is None else _per_million(value, field))
    given_in, given_out, cached, write = values
    if given_in is None:
        return None
    if given_out is None:
        if model is not None:
            given_out = model.output
        elif info.get("mode") == "embedding":
            given_out = Decimal(0)
        else:
            raise ValueError("an input price but no output price, and no model priced")
    if model is not None:
        # LiteLLM bills a custom-priced deployment's cache tokens at its model's cache prices
        # where it names none.
        cached = model.cached_input if cached is None else cached
        write = model.cache_write if write is None else write
    return Price.of(given_in, given_out, cached, write)


def _per_million(value: Any, field: str) -> Decimal:
    """A per-token USD price as USD per 1M tokens, exactly."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: not a number")
    try:
        if isinstance(value, float):
            # The shortest repr that round-trips: 1.5e-07 is 1.5e-07, not the binary
            # neighbour 1.49999999999999993e-07, and times 10^6 exactly 0.15.
            amount = Decimal(repr(value))
        elif isinstance(value, (int, Decimal)):
            amount = Decimal(value)
        elif isinstance(value, str):
            amount = Decimal(value.strip())
        else:
            raise ValueError(f"{field}: not a number")
    except InvalidOperation:
        raise ValueError(f"{field}: not a number") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{field}: must be a finite, non-negative number")
    return amount * _PER_MILLION


def _distinct(prices: Iterable[Price | None]) -> list[Price | None]:
    out: list[Price | None] = []
    for price in prices:
        if price not in out:
            out.append(price)
    return out


def _dearest(prices: Sequence[Price]) -> Price:
    """The dearest of each price, long-context tiers included: no deployment's charge for any
    prompt is above it."""
    flat = [*prices, *(tier.price for p in prices for tier in p.tiers)]
    return Price.of(
        max(p.input for p in flat),
        max(p.output for p in flat),
        max(p.cached_input for p in flat),
        max(p.cache_write for p in flat),
    )


def _key(name: str) -> str:
    return name.strip().lower()


_warned: set[str] = set()


def _warn(what: str, message: str, *args: object) -> None:
    if what in _warned or len(_warned) >= _WARNED_MAX:
        return
    _warned.add(what)
    log.warning(message, *args)


# ----------------------------------------------------------------------------- the running proxy


def litellm_routing(apps: Iterable[object], base: PriceTable) -> LiteLLMRouting | None:
    """The LiteLLM proxy's routing, if one of ``apps`` (the ASGI scope's app, the app the
    middleware wraps) is LiteLLM's app or wraps it; None otherwise. ``base``: the table its
    names are laid over, each time anew."""
    proxy = sys.modules.get(PROXY_MODULE)
    if proxy is None:  # the app is not LiteLLM's: it would have imported this module
        return None
    target = getattr(proxy, "app", None)
    if target is None or not any(_leads_to(app, target) for app in apps):
        return None
    return LiteLLMRouting(proxy, base)


def _leads_to(app: object, target: object) -> bool:
    for _ in range(32):  # through any middleware wrapped around it
        if app is None:
            return False
        if app is target:
            return True
        app = getattr(app, "app", None)
    return False


class LiteLLMRouting:
    """The running proxy's router, read into price tables (``prices``) and the deployment
    that served a response (``routed``)."""

    def __init__(self, proxy: ModuleType, base: PriceTable) -> None:
        self._proxy = proxy
        self._base = base
        self._seen: str | None = None  # the model_list last read, as a fingerprint
        self._routed: Mapping[str, str] = {}
        self._due = 0.0  # monotonic time of the next read
        self._read = -RESYNC_SECONDS  # of the last

    def prices(self, now: float | None = None) -> PriceTable | None:
        """A new price table when the router's ``model_list`` changed since the last read;
        None when it did not, when no read is due, or when there is no router yet."""
        now = time.monotonic() if now is None else now
        if now < self._due:
            return None
        self._read, self._due = now, now + RESYNC_SECONDS
        router = getattr(self._proxy, "llm_router", None)
        model_list = getattr(router, "model_list", None)
        if not isinstance(model_list, list):
            return None  # LiteLLM's startup has not made its router (yet)
        group_aliases = getattr(router, "model_group_alias", None)
        if not isinstance(group_aliases, Mapping):
            group_aliases = None
        try:
            seen = _fingerprint(model_list, group_aliases)
            if seen == self._seen:
                return None
            built = router_prices(self._base, model_list, group_aliases)
            table = self._base.with_aliases(built.aliases)
        except Exception:  # LiteLLM's shapes are its own: never fail a request over them
            log.exception("spendguard could not read LiteLLM's model_list")
            return None
        self._seen, self._routed = seen, built.routed
        _report(built)
        return table

    def routed(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The name to charge the deployment that served this response under, from LiteLLM's
        ``x-litellm-model-id``; None without the header or for a deployment not read yet
        (which brings the next read forward)."""
        for name, value in headers:
            if name.lower() == MODEL_ID_HEADER:
                found = self._routed.get(value.decode("latin-1"))
                if found is None:
                    self._due = min(self._due, self._read + _RETRY_SECONDS)
                return found
        return None


def _fingerprint(model_list: list[Any], group_aliases: Mapping[str, Any] | None) -> str:
    """What of a model_list prices it (never its keys or endpoints), as one comparable string."""
    parts: list[object] = []
    for item in model_list:
        if not isinstance(item, Mapping):
            continue
        params, info = item.get("litellm_params"), item.get("model_info")
        params = params if isinstance(params, Mapping) else {}
        info = info if isinstance(info, Mapping) else {}
        parts.append(
            (
                item.get("model_name"),
                params.get("model"),
                params.get("base_model"),
                info.get("id"),
                info.get("base_model"),
                info.get("mode"),
                tuple(params.get(f) for f in _COSTS),
                tuple(info.get(f) for f in _COSTS),
            )
        )
    return repr((parts, sorted((group_aliases or {}).items(), key=repr)))


def _report(built: RouterPrices) -> None:
    names = []
    for name, ref in built.aliases.items():
        if "@" in name and isinstance(ref, Price) and name.split("@")[-1] in built.routed:
            continue  # a deployment's own name: reported with its model_name
        names.append(f"{name} as {ref}" if isinstance(ref, str) else f"{name} at its own price")
    shown = ", ".join(names[:_LOGGED_NAMES]) + (", ..." if len(names) > _LOGGED_NAMES else "")
    log.info(
        "spendguard prices LiteLLM's model_list: %d names (%s), %d deployments known by id",
        len(names),
        shown or "none",
        len(built.routed),
    )
    for name in built.unpriced:
        _warn(
            f"unpriced:{name}",
            "spendguard: LiteLLM model %r has a deployment with no price (no entry for its "
            "litellm_params.model or model_info.base_model, no input_cost_per_token): it is an "
            "unknown model (SPENDGUARD_UNKNOWN_MODEL)",
            name,
        )
