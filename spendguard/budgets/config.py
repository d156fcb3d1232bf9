"""The budgets section: parsed, validated, frozen (docs/rolling-budgets.md).

A budgets file is JSON or YAML, either the section itself or a document with a top-level
``budgets:`` key::

    enabled: true
    storage: redis          # memory | redis
    fail_open: true
    windows:
      - {id: daily, period: 24h}
      - {id: monthly, period: calendar:month}   # an alias of 30d, not a calendar reset
    scopes:
      per_api_key: {tokens: 2000000, cost_usd: 50}
      per_end_user: {cost_usd: 5, windows: {daily: {requests: 1000}}}  # its own amounts there
      per_model: {gpt-4o: {tokens: 500000}}
      global: {tokens: 20000000, cost_usd: 500}

Every problem is reported at once, each naming its field (``budgets.windows[1].period: ...``),
as one :class:`BudgetConfigError`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigurationError
from ..limits.model import BudgetLimit, SubjectKind
from ..limits.percentages import parse_thresholds
from ..limits.windows import Period, Rolling
from ..money import MAX_AMOUNT_MICROS, usd_to_micros

# Every window is cut into this many equal slices; usage leaves a window one slice at a time.
# Long enough for any quota an operator means; keeps key TTLs and slice indices small.
MAX_PERIOD_SECONDS = 400 * 86_400
# The most tokens one limit may name: far above any real quota, far below 2^53 (Lua numbers).
MAX_TOKENS = 10**15
DEFAULT_HOLD_SECONDS = 900

_UNITS = {"m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_PERIOD = re.compile(r"([1-9][0-9]{0,5})([mhdw])")
# Calendar names are aliases of fixed lengths here, never midnight or 1st-of-month resets
# (as the design document budgets follow says); the utc: ones are the UTC calendar's own.
_ALIASES = {"calendar:day": 86_400, "calendar:month": 30 * 86_400}
_CALENDAR = {"utc:day": Period.DAY, "utc:month": Period.MONTH}
_CALENDAR_SECONDS = {Period.DAY: 86_400, Period.MONTH: 31 * 86_400}  # the longest
# Window ids reach Redis key names and metric labels.
_WINDOW_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_MODEL_NAME = 256


class BudgetConfigError(ConfigurationError):
    """The budgets section is invalid; ``problems`` lists each one, naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid budgets: " + "; ".join(problems))


class Storage(StrEnum):
    MEMORY = "memory"
    REDIS = "redis"


class Scope(StrEnum):
    """In check order: the key's own bucket, the end user's, each tag's, the customer's, the
    model's, then the fleet's (the section's names for the subjects of the limit model)."""

    PER_API_KEY = "per_api_key"
    PER_END_USER = "per_end_user"
    PER_TAG = "per_tag"
    PER_CUSTOMER = "per_customer"
    PER_MODEL = "per_model"
    GLOBAL = "global"

    @property
    def kind(self) -> SubjectKind:
        return _KINDS[self]


_KINDS = {
    Scope.PER_API_KEY: SubjectKind.API_KEY,
    Scope.PER_END_USER: SubjectKind.END_USER,
    Scope.PER_TAG: SubjectKind.TAG,
    Scope.PER_CUSTOMER: SubjectKind.CUSTOMER,
    Scope.PER_MODEL: SubjectKind.MODEL,
    Scope.GLOBAL: SubjectKind.FLEET,
}


def parse_period(text: str) -> int:
    """Seconds of a period: ``<n>m``, ``<n>h``, ``<n>d``, ``<n>w``, ``calendar:day`` (24h) or
    ``calendar:month`` (30d); ``utc:day`` and ``utc:month`` (the UTC calendar's: a day, the
    longest month). ValueError when it is none of them."""
    if not isinstance(text, str):
        raise ValueError(f"not a period: {text!r}")
    if text in _ALIASES:
        return _ALIASES[text]
    if text in _CALENDAR:
        return _CALENDAR_SECONDS[_CALENDAR[text]]
    match = _PERIOD.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a period (use <n>m, <n>h, <n>d, <n>w, calendar:day, "
            "calendar:month, utc:day or utc:month)"
        )
    seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_PERIOD_SECONDS:
        raise ValueError(f"{text!r} is longer than {MAX_PERIOD_SECONDS // 86_400} days")
    return seconds


def make_window(window_id: str, period: str) -> Rolling:
    """The window ``period`` names (ValueError when it names none): rolling, or the UTC
    calendar's day or month (``utc:day``, ``utc:month``)."""
    return Rolling(window_id, period, parse_period(period), _CALENDAR.get(period))


@dataclass(frozen=True, slots=True)
class BudgetsConfig:
    enabled: bool = False
    storage: Storage = Storage.MEMORY
    fail_open: bool = True
    windows: tuple[Rolling, ...] = ()
    per_api_key: BudgetLimit | None = None
    per_model: Mapping[str, BudgetLimit] = field(default_factory=dict)
    global_: BudgetLimit | None = None
    # Every end user's own bucket (within its team), from its first request on.
    per_end_user: BudgetLimit | None = None
    # Per tag (``*``: every tag not named), each tag's bucket shared by the whole fleet.
    per_tag: Mapping[str, BudgetLimit] = field(default_factory=dict)
    # Per customer, the level above teams (``*``: every customer not named), shared by its
    # teams.
    per_customer: Mapping[str, BudgetLimit] = field(default_factory=dict)
    hold_seconds: int = DEFAULT_HOLD_SECONDS
    # The output a request without max_tokens reserves here; None: the gateway's setting
    # (SPENDGUARD_DEFAULT_OUTPUT_TOKENS), the one the spend limits reserve too.
    default_output_tokens: int | None = None
    # The alert thresholds of a limit without its own (a key's override from the ledger too).
    alert_at: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        """Enabled, with at least one window and one limit: anything to check at all."""
        return self.enabled and bool(self.windows) and self.has_limits

    @property
    def has_limits(self) -> bool:
        return (
            self.per_api_key is not None
            or bool(self.per_model)
            or self.global_ is not None
            or self.per_end_user is not None
            or bool(self.per_tag)
            or bool(self.per_customer)
        )

    def tag_limit(self, tag: str) -> BudgetLimit | None:
        """The limit of ``tag``: its own, else the ``*`` default, else none."""
        found = self.per_tag.get(tag)
        return found if found is not None else self.per_tag.get("*")

    def customer_limit(self, customer: str) -> BudgetLimit | None:
        """The limit of ``customer``: its own, else the ``*`` default, else none."""
        found = self.per_customer.get(customer)
        return found if found is not None else self.per_customer.get("*")

    @property
    def longest_ms(self) -> int:
        return max((w.period_ms for w in self.windows), default=0)

    def window(self, window_id: str) -> Rolling | None:
        return next((w for w in self.windows if w.id == window_id), None)

    def as_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "storage": self.storage.value,
            "fail_open": self.fail_open,
            "hold_seconds": self.hold_seconds,
            # null: the gateway's SPENDGUARD_DEFAULT_OUTPUT_TOKENS
            "default_output_tokens": self.default_output_tokens,
            "alert_at": list(self.alert_at),
            "windows": [
                {"id": w.id, "period": w.period, "seconds": w.seconds} for w in self.windows
            ],
            "scopes": {
                "per_api_key": None if self.per_api_key is None else self.per_api_key.as_json(),
                "per_model": {m: lim.as_json() for m, lim in self.per_model.items()},
                "global": None if self.global_ is None else self.global_.as_json(),
                "per_end_user": (
                    None if self.per_end_user is None else self.per_end_user.as_json()
                ),
                "per_tag": {t: lim.as_json() for t, lim in self.per_tag.items()},
                "per_customer": {c: lim.as_json() for c, lim in self.per_customer.items()},
            },
            "cost_source": "model_metadata",
        }


DISABLED = BudgetsConfig()


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")


def _keys(
    value: object, where: str, allowed: set[str], problems: _Problems
) -> Mapping[str, Any] | None:
    if not isinstance(value, Mapping):
        problems.add(where, f"must be a mapping, got {type(value).__name__}")
        return None
    for key in value:
        if key not in allowed:
            problems.add(f"{where}.{key}", f"unknown field (known: {', '.join(sorted(allowed))})")
    return value


def _bool(value: object, where: str, default: bool, problems: _Problems) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        problems.add(where, f"must be true or false, got {value!r}")
        return default
    return value


def _alert_at(value: object, where: str, problems: _Problems) -> tuple[int, ...] | None:
    """A list of whole percentages (None: not given)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        problems.add(where, f"must be a list of whole percentages, got {value!r}")
        return None
    try:
        return parse_thresholds(value)
    except ValueError as exc:
        problems.add(where, str(exc))
        return None


def _limit(
    value: object,
    where: str,
    problems: _Problems,
    alert_at: tuple[int, ...] = (),
    window_ids: frozenset[str] | None = None,
    *,
    inherited_fit: bool | None = None,
) -> BudgetLimit | None:
    """A scope's limit; ``alert_at``: the section's thresholds, for a limit without its own.
    ``window_ids``: the section's windows, which ``windows:`` may give amounts of their own
    (None: a window's own amounts, which can't nest)."""
    if value is None:
        return None
    known = {"tokens", "cost_usd", "requests", "alert_at", "fit"}
    data = _keys(value, where, known if window_ids is None else known | {"windows"}, problems)
    if data is None:
        return None
    own = _alert_at(data.get("alert_at"), f"{where}.alert_at", problems)
    alerts = alert_at if own is None else own
    fit = data.get("fit", inherited_fit)
    if fit is not None and not isinstance(fit, bool):
        problems.add(f"{where}.fit", f"must be true or false, got {fit!r}")
        fit = None
    tokens = _count(data.get("tokens"), f"{where}.tokens", problems)
    requests = _count(data.get("requests"), f"{where}.requests", problems)
    raw_cost = data.get("cost_usd")
    cost = None if raw_cost is None else _cost(raw_cost, f"{where}.cost_usd", problems)
    by_window: list[tuple[str, BudgetLimit]] = []
    raw_windows = data.get("windows")
    if raw_windows is not None and window_ids is not None:
        if not isinstance(raw_windows, Mapping) or not raw_windows:
            problems.add(f"{where}.windows", "must map window ids to their own amounts")
        else:
            for wid, raw in raw_windows.items():
                inner = f"{where}.windows.{wid}"
                if wid not in window_ids:
                    problems.add(inner, f"no such window (known: {', '.join(sorted(window_ids))})")
                    continue
                limit = _limit(raw, inner, problems, alerts, inherited_fit=fit)
                if limit is None and raw is None:
                    problems.add(inner, "set tokens, cost_usd, requests or any of them")
                if limit is not None:
                    by_window.append((str(wid), limit))
    if tokens is None and cost is None and requests is None and not by_window:
        if not ({"tokens", "cost_usd", "requests", "windows"} & set(data)):
            problems.add(where, "set tokens, cost_usd, requests or any of them")
        return None
    return BudgetLimit(tokens, cost, alerts, requests, tuple(by_window), fit)


def _count(value: object, where: str, problems: _Problems) -> int | None:
    """A whole number of tokens or requests (None: not given)."""
    if value is None:
        return None
    if type(value) is not int:
        problems.add(where, f"must be a whole number, got {value!r}")
    elif value <= 0:
        problems.add(where, f"must be greater than 0, got {value}")
    elif value > MAX_TOKENS:
        problems.add(where, f"must be at most {MAX_TOKENS}")
    else:
        return value
    return None


def _cost(value: object, where: str, problems: _Problems) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        problems.add(where, f"must be a number of USD, got {value!r}")
        return None
    if isinstance(value, float) and not math.isfinite(value):
        problems.add(where, f"must be finite, got {value!r}")
        return None
    try:
        # Through str: 0.1 in YAML means ten cents, not the binary float's expansion.
        amount = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except InvalidOperation:
        problems.add(where, f"must be a number of USD, got {value!r}")
        return None
    if not amount.is_finite():
        problems.add(where, f"must be finite, got {value!r}")
        return None
    if amount <= 0:
        problems.add(where, f"must be greater than 0, got {value!r}")
        return None
    try:
        micros = usd_to_micros(amount)
    except ValueError as exc:
        problems.add(where, str(exc))
        return None
    if micros > MAX_AMOUNT_MICROS:
        problems.add(where, f"must be at most {MAX_AMOUNT_MICROS // 1_000_000} USD")
        return None
    return micros


def _windows(value: object, problems: _Problems) -> tuple[Rolling, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        problems.add("budgets.windows", "must be a list of {id, period}")
        return ()
    out: list[Rolling] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"budgets.windows[{i}]"
        data = _keys(item, where, {"id", "period"}, problems)
        if data is None:
            continue
        window_id, period = data.get("id"), data.get("period")
        ok = True
        if not isinstance(window_id, str) or _WINDOW_ID.fullmatch(window_id) is None:
            problems.add(f"{where}.id", f"must be 1-64 of A-Z a-z 0-9 _ . -, got {window_id!r}")
            ok = False
        elif window_id in seen:
            problems.add(f"{where}.id", f"duplicate window id {window_id!r}")
            ok = False
        else:
            seen.add(window_id)
        try:
            parse_period(period)  # type: ignore[arg-type]
        except ValueError as exc:
            problems.add(f"{where}.period", str(exc))
            ok = False
        if ok:
            out.append(make_window(str(window_id), str(period)))
    return tuple(out)


def _models(
    value: object,
    problems: _Problems,
    alert_at: tuple[int, ...] = (),
    scope: str = "per_model",
    window_ids: frozenset[str] = frozenset(),
) -> dict[str, BudgetLimit]:
    """A scope that maps names (models, tags) to limits."""
    what = {"per_model": "model", "per_tag": "tag"}.get(scope, "customer")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.add(f"budgets.scopes.{scope}", f"must map {what} names to limits")
        return {}
    out: dict[str, BudgetLimit] = {}
    for name, raw in value.items():
        if not isinstance(name, str) or not name.strip():
            problems.add(f"budgets.scopes.{scope}", f"empty {what} name {name!r}")
            continue
        if len(name) > _MAX_MODEL_NAME or not name.isprintable():
            problems.add(f"budgets.scopes.{scope}", f"unusable {what} name {name[:40]!r}")
            continue
        where = f"budgets.scopes.{scope}.{name}"
        if raw is None:
            problems.add(where, "set tokens, cost_usd, requests or any of them")
            continue
        limit = _limit(raw, where, problems, alert_at, window_ids)
        if limit is not None:
            out[name] = limit
    return out


def parse_budgets(document: object) -> BudgetsConfig:
    """The budgets section of ``document`` (the section itself, or ``{"budgets": ...}``)."""
    problems = _Problems()
    if document is None:
        return DISABLED
    if isinstance(document, Mapping) and set(document) == {"budgets"}:
        document = document["budgets"]
        if document is None:
            return DISABLED
    allowed = {"enabled", "storage", "fail_open", "windows", "scopes", "cost_source", "alert_at"}
    data = _keys(document, "budgets", allowed | {"hold_seconds", "default_output_tokens"}, problems)
    if data is None:
        raise BudgetConfigError(problems.items)
    enabled = _bool(data.get("enabled"), "budgets.enabled", False, problems)
    fail_open = _bool(data.get("fail_open"), "budgets.fail_open", True, problems)
    storage = Storage.MEMORY
    raw_storage = data.get("storage")
    if raw_storage is not None:
        try:
            storage = Storage(raw_storage)
        except ValueError:
            problems.add("budgets.storage", f"must be memory or redis, got {raw_storage!r}")
    cost_source = data.get("cost_source")
    if cost_source not in (None, "model_metadata"):
        problems.add(
            "budgets.cost_source", f"only model_metadata is supported, got {cost_source!r}"
        )
    hold = data.get("hold_seconds", DEFAULT_HOLD_SECONDS)
    if type(hold) is not int or not 10 <= hold <= 86_400:
        problems.add("budgets.hold_seconds", f"must be a whole number 10..86400, got {hold!r}")
        hold = DEFAULT_HOLD_SECONDS
    output = data.get("default_output_tokens")
    if output is not None and (type(output) is not int or not 1 <= output <= 10_000_000):
        problems.add(
            "budgets.default_output_tokens", f"must be a whole number 1..10000000, got {output!r}"
        )
        output = None
    windows = _windows(data.get("windows"), problems)
    # The thresholds of every limit without its own (none by default).
    alert_at = _alert_at(data.get("alert_at"), "budgets.alert_at", problems) or ()
    per_key = model_limits = global_ = per_end_user = tag_limits = customer_limits = None
    scopes = data.get("scopes")
    if scopes is not None:
        scope_data = _keys(scopes, "budgets.scopes", {s.value for s in Scope}, problems)
        if scope_data is not None:
            ids = frozenset(w.id for w in windows)

            def scope_limit(name: str) -> BudgetLimit | None:
                where = f"budgets.scopes.{name}"
                return _limit(scope_data.get(name), where, problems, alert_at, ids)

            def named(name: str) -> dict[str, BudgetLimit]:
                return _models(scope_data.get(name), problems, alert_at, name, ids)

            per_key, global_, per_end_user = (
                scope_limit("per_api_key"),
                scope_limit("global"),
                scope_limit("per_end_user"),
            )
            model_limits, tag_limits = named("per_model"), named("per_tag")
            customer_limits = named("per_customer")
    config = BudgetsConfig(
        enabled=enabled,
        storage=storage,
        fail_open=fail_open,
        windows=windows,
        per_api_key=per_key,
        per_model=model_limits or {},
        global_=global_,
        per_end_user=per_end_user,
        per_tag=tag_limits or {},
        per_customer=customer_limits or {},
        hold_seconds=hold,
        default_output_tokens=output,
        alert_at=alert_at,
    )
    raw_windows = data.get("windows")
    if enabled and config.has_limits and not raw_windows:
        problems.add("budgets.windows", "the section is enabled and has limits but no windows")
    if problems.items:
        raise BudgetConfigError(problems.items)
    return config


def read_budgets(path: str | Path) -> BudgetsConfig:
    """Parse and validate a budgets file (.json, .yaml or .yml)."""
    path = Path(path)
    label = f"budgets file {path}"
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise BudgetConfigError([f"{label}: cannot read: {exc.strerror or exc}"]) from exc
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            document = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            document = yaml.safe_load(text)
        else:
            raise BudgetConfigError([f"{label}: use .json, .yaml or .yml"])
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise BudgetConfigError([f"{label}: not valid {suffix[1:].upper()}: {exc}"]) from exc
    return parse_budgets(document)
