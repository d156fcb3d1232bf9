"""The limit vocabulary (design.md, "The limit model"): typed values, no strings.

A :class:`Limit` names what it limits (its :class:`Subject`), over which :data:`Window`, in
which :class:`Unit`. A :class:`Policy` is a limit with an amount, as an operator set it. A
team's prepaid account is its own kind, :class:`Balance`: it has no window and never resets.
Everything that is checked before an inference is a :data:`Target` (a limit or a balance).

Turning these values into cache keys and back happens in one place only,
:mod:`spendguard.limits.codec`; the ledger, the engine, the worker and the CLI pass the values.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from ..identity import Identity
from .windows import Period, Window


class SubjectKind(StrEnum):
    """Who or what a limit applies to. Spend limits have team and API key subjects; budgets
    (their own section) API keys, end users, tags, models and the fleet; the provider pool
    its keys."""

    TEAM = "team"
    API_KEY = "api_key"
    END_USER = "end_user"  # whom the app bills within a team (a request's end user)
    CUSTOMER = "customer"  # the organisation above teams (a request's customer)
    TAG = "tag"  # what a request is for (a feature, a project, an environment)
    MODEL = "model"
    FLEET = "fleet"
    PROVIDER_KEY = "provider_key"


@dataclass(frozen=True, slots=True)
class Subject:
    """Who a limit applies to: a team, or one API key of a team (encoded ids)."""

    team: str
    api_key: str | None = None

    @property
    def kind(self) -> SubjectKind:
        return SubjectKind.TEAM if self.api_key is None else SubjectKind.API_KEY

    def covers(self, api_key: str | None) -> bool:
        """Whether spend through ``api_key`` (of this subject's team) counts against it."""
        return self.api_key is None or self.api_key == api_key


class Unit(StrEnum):
    USD = "usd"  # amounts are integer micro-USD (1 USD = 1,000,000)
    TOKENS = "tokens"  # prompt, output, cached and cache-write tokens together
    REQUESTS = "requests"  # requests admitted (RPM)
    IN_FLIGHT = "in_flight"  # requests admitted and not finished (a parallel cap)


class Mode(StrEnum):
    """How a limit admits. Soft: while usage is below it (the request is charged after, so
    the last one may pass it). Hard: only if the request's worst case fits, held from
    admission to its end and trued up to what it used."""

    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True, slots=True)
class Limit:
    subject: Subject
    window: Window
    unit: Unit = Unit.USD

    @property
    def team(self) -> str:
        return self.subject.team


@dataclass(frozen=True, slots=True)
class BudgetLimit:
    """A budget's amounts over each rolling window: ``tokens``, ``cost_micros`` and
    ``requests``, any of them (each > 0); the request must fit under each (a hard limit: its
    estimate, and one request, are held). ``by_window`` gives some windows amounts of their
    own, replacing these there (a requests-per-minute rate beside a daily token quota)."""

    tokens: int | None = None
    cost_micros: int | None = None
    # Percentages of each amount that alert, at most once per window length (``()``: none).
    alert_at: tuple[int, ...] = ()
    requests: int | None = None  # requests admitted (a rolling RPM over a 1m window)
    by_window: tuple[tuple[str, BudgetLimit], ...] = ()  # (window id, its own amounts)
    # A request whose output cap doesn't fit is fitted to what is left (True) or refused
    # (False) instead; None: as the gateway's SPENDGUARD_FIT_BY_DEFAULT says.
    fit: bool | None = None

    @property
    def has_amount(self) -> bool:
        return self.tokens is not None or self.cost_micros is not None or self.requests is not None

    def in_window(self, window_id: str) -> BudgetLimit | None:
        """The amounts that apply in ``window_id``: its own, else these (None: none there)."""
        for wid, own in self.by_window:
            if wid == window_id:
                return own
        return self if self.has_amount else None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tokens is not None:
            out["tokens"] = self.tokens
        if self.cost_micros is not None:
            out["cost_usd"] = str(Decimal(self.cost_micros) / 1_000_000)
        if self.requests is not None:
            out["requests"] = self.requests
        if self.alert_at:
            out["alert_at"] = list(self.alert_at)
        if self.fit is not None:
            out["fit"] = self.fit
        if self.by_window:
            out["windows"] = {wid: own.as_json() for wid, own in self.by_window}
        return out


@dataclass(frozen=True, slots=True)
class Balance:
    """A team's prepaid account: topped up minus charged, in micro-USD; no window."""

    team: str


Target = Limit | Balance


@dataclass(frozen=True, slots=True)
class Policy:
    """A limit an operator set, with the raw ids the host app gave (for display only)."""

    limit: Limit
    amount: int  # in the limit's unit
    team_id: str
    api_key_id: str | None = None
    # Hard: a request is admitted only if its worst case fits under the limit, held from
    # admission to its end. Soft: admitted while usage is below the limit.
    hard: bool = False
    # Percentages of the limit that alert once per window (``()``: none); None: the
    # gateway's default thresholds.
    alert_at: tuple[int, ...] | None = None
    # Hard only: a request whose output cap doesn't fit is fitted to what is left instead
    # of refused (with SPENDGUARD_FIT_MIN_OUTPUT_TOKENS; every hard limit fits then unless
    # SPENDGUARD_FIT_BY_DEFAULT is false, and then only those that say so).
    fit: bool = False

    @property
    def mode(self) -> Mode:
        return Mode.HARD if self.hard else Mode.SOFT


def team_limit(identity: Identity, window: Window) -> Limit:
    return Limit(Subject(identity.team), window)


def key_limit(identity: Identity, window: Window) -> Limit:
    if identity.api_key is None:
        raise ValueError("an API key limit needs an identity with an API key")
    return Limit(Subject(identity.team, identity.api_key), window)


def limit_for(identity: Identity, window: Window) -> Limit:
    """The identity's own limit: its key's when it names one, else its team's."""
    subject = Subject(identity.team, identity.api_key)
    return Limit(subject, window)


def applicable(identity: Identity) -> tuple[Target, ...]:
    """Every target that may apply to a request of ``identity``, in check order: the
    narrowest limit first (a key before its team, a day before its month), then the balance,
    so a denial names the most specific problem."""
    targets: list[Target] = []
    if identity.api_key is not None:
        targets += [key_limit(identity, Period.DAY), key_limit(identity, Period.MONTH)]
    targets += [team_limit(identity, Period.DAY), team_limit(identity, Period.MONTH)]
    targets.append(Balance(identity.team))
    return tuple(targets)
