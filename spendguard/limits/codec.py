"""The one codec between typed limits and strings (design.md, "Cache keys").

Cache key names, policy-hash fields and window names are made here and decoded here, nowhere
else. The layout::

    {prefix}:{team}:spend:policy                                hash: field -> amount
    {prefix}:{team}:spend:usage:team:month:YYYYMM               usage of a team limit
    {prefix}:{team}:spend:usage:team:day:YYYYMMDD
    {prefix}:{team}:spend:usage:api_key:<key>:day:YYYYMMDD      usage of an API key limit
    {prefix}:{team}:spend:usage:api_key:<key>:month:YYYYMM
    {prefix}:{team}:spend:balance                               the team's prepaid account
    {prefix}:{team}:spend:open                                  admission entries: id -> entry
    {prefix}:{team}:spend:rate:team                             the team's request rates
    {prefix}:{team}:spend:rate:api_key:<key>                    a key's request rates
    {prefix}:spend:owners                                       gateways that wrote entries
    {prefix}:spend:owner:{owner}:alive / :teams                 an owner's heartbeat, its teams

``team`` and ``key`` are encoded ids (:func:`spendguard.identity.encode_id`: no ``:``, braces
or whitespace), so every key of one request hashes to the team's cluster slot and no id can
reach outside its segment. A policy-hash field names a target without the prefix:
``team:month``, ``api_key:<key>:day``, ``balance``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ..identity import Identity
from ..money import MAX_AMOUNT_MICROS
from .model import Balance, Limit, Policy, Subject, SubjectKind, Target, applicable
from .models import ALLOW_PREFIX, allow_field
from .models import encode as encode_models
from .rates import Rates, rate_field
from .windows import Period, Window

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# Marks a policy hash as loaded from the ledger, so a missing field means "no policy" (negative
# caching) instead of "not loaded yet".
LOADED_FIELD = "_loaded"
# A hard limit's field in the policy hash: this prefix and its soft field (``h:team:month``).
HARD_PREFIX = "h:"
# A hard limit that fits a refused request's output cap instead (its opt-in): this prefix
# instead of HARD_PREFIX (``f:team:month``).
FIT_PREFIX = "f:"
# A limit's own alert thresholds: this prefix and its soft field (``a:team:month`` ->
# ``"50,80"``; ``""``: none). Absent: the gateway's default thresholds apply.
ALERT_PREFIX = "a:"
# The policy-hash field saying the team has a prepaid account (its value is 1). The balance
# itself lives in the balance key: t (topped up), s (settled charges), p (pending estimates).
BALANCE_FIELD = "balance"


def window_of(name: str) -> Window:
    """Decode a window name (a ledger column, a CLI argument); ValueError if unknown."""
    return Period(name)


def field_of(target: Target) -> str:
    """The policy-hash field of a target."""
    if isinstance(target, Balance):
        return BALANCE_FIELD
    subject = target.subject
    if subject.kind is SubjectKind.TEAM:
        return f"team:{target.window.value}"
    return f"api_key:{subject.api_key}:{target.window.value}"


def parse_field(team: str, field: str) -> Target | None:
    """Inverse of :func:`field_of` for ``team``'s hash; None for the loaded marker or junk."""
    if field == BALANCE_FIELD:
        return Balance(team)
    parts = field.split(":")
    try:
        if len(parts) == 2 and parts[0] == SubjectKind.TEAM:
            return Limit(Subject(team), window_of(parts[1]))
        if len(parts) == 3 and parts[0] == SubjectKind.API_KEY and parts[1]:
            return Limit(Subject(team, parts[1]), window_of(parts[2]))
    except ValueError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class Check:
    """One target a request may be subject to, located in the cache for ``t0``."""

    target: Target
    bucket: str  # the window's id at t0 ("" for a balance)
    field: str  # policy-hash field
    usage_key: str
    expires_at: datetime  # window end + grace: a closed window's key outlives it a while


@dataclass(frozen=True, slots=True)
class KeyPlan:
    """Every cache key one request touches."""

    team: str
    policy_key: str
    checks: tuple[Check, ...]  # in check order
    # The policy-hash fields of the model lists that apply: the team's, the key's ("" none).
    allow_fields: tuple[str, str] = (ALLOW_PREFIX, "")
    # The policy-hash fields of the rates that apply and their rate hashes: the key's ("" for
    # none: its key name is then the team's, never touched), then the team's.
    rate_fields: tuple[str, str] = ("", "rate:")
    rate_keys: tuple[str, str] = ("", "")

    def find(self, target: Target) -> Check:
        """The check of ``target``; KeyError when it does not apply to this request."""
        for check in self.checks:
            if check.target == target:
                return check
        raise KeyError(target)


class _Stems:
    """What a plan of one identity shares with every other plan of it, and its latest plan.

    All windows are UTC calendar windows, so a plan stays the same for every ``t0`` of one UTC
    day: the last one built is kept with the span it holds for, and a request within that span
    takes it as is (no bucket formatting, no allocation).
    """

    __slots__ = (
        "entries",
        "plan",
        "policy_key",
        "rate_fields",
        "rate_keys",
        "valid_from",
        "valid_until",
    )

    def __init__(
        self,
        policy_key: str,
        entries: tuple[tuple[Target, str, str], ...],
        rate_fields: tuple[str, str],
        rate_keys: tuple[str, str],
    ) -> None:
        self.policy_key = policy_key
        self.entries = entries  # target, field, usage key without the bucket
        self.rate_fields = rate_fields
        self.rate_keys = rate_keys
        self.plan: KeyPlan | None = None
        self.valid_from = self.valid_until = _EPOCH


class KeyCodec:
    """Key names under one prefix. ``grace`` is how long a usage key outlives its window."""

    __slots__ = ("_stems", "grace", "prefix")

    # The per-identity part of a plan (targets, fields, key names up to the bucket) is kept
    # for this many identities: a request then only computes its window buckets.
    MAX_CACHED_IDENTITIES = 10_000

    def __init__(self, prefix: str, grace: timedelta) -> None:
        self.prefix = prefix
        self.grace = grace
        self._stems: dict[tuple[str, str | None], _Stems] = {}

    @property
    def remembered(self) -> int:
        """How many identities' plan parts are kept (bounded by MAX_CACHED_IDENTITIES)."""
        return len(self._stems)

    def policy_key(self, team: str) -> str:
        return f"{self.prefix}:{{{team}}}:spend:policy"

    def balance_key(self, team: str) -> str:
        return f"{self.prefix}:{{{team}}}:spend:balance"

    def entries_key(self, team: str) -> str:
        """The team's admission entries (hash: record id -> entry), in the team's slot so the
        preflight and postflight scripts write them in the same call."""
        return f"{self.prefix}:{{{team}}}:spend:open"

    def alerts_key(self, team: str) -> str:
        """The team's threshold alerts fired and not in the ledger's outbox yet (hash), in the
        team's slot so the postflight script fires them in the same call."""
        return f"{self.prefix}:{{{team}}}:spend:alerts"

    def owners_key(self) -> str:
        """Every gateway process that may have left admission entries (set of owner ids)."""
        return f"{self.prefix}:spend:owners"

    def owner_alive_key(self, owner: str) -> str:
        return f"{self.prefix}:spend:owner:{{{owner}}}:alive"

    def owner_teams_key(self, owner: str) -> str:
        """The teams an owner wrote entries for (set), so recovery finds them."""
        return f"{self.prefix}:spend:owner:{{{owner}}}:teams"

    def rate_key(self, team: str, api_key: str | None) -> str:
        """The rate hash of a key (or, with None, of the team): counters and requests in
        flight (see :mod:`spendguard.limits.rates`)."""
        subject = "team" if api_key is None else f"api_key:{api_key}"
        return f"{self.prefix}:{{{team}}}:spend:rate:{subject}"

    def _usage_stem(self, target: Limit) -> str:
        return f"{self.prefix}:{{{target.team}}}:spend:usage:{field_of(target)}:"

    def usage_key(self, target: Target, bucket: str) -> str:
        """The key holding ``target``'s usage in window ``bucket`` (the balance has one)."""
        if isinstance(target, Balance):
            return self.balance_key(target.team)
        return self._usage_stem(target) + bucket

    def check(self, target: Target, t0: datetime) -> Check:
        return self._located(target, *self._parts(target), t0, {})

    def plan(self, identity: Identity, t0: datetime) -> KeyPlan:
        """Every check that may apply to ``identity`` at ``t0`` (the store skips unset ones)."""
        stems = self._stems.get((identity.team, identity.api_key))
        if stems is None:
            stems = self._remember(identity)
        plan = stems.plan
        if plan is not None and stems.valid_from <= t0 < stems.valid_until:
            return plan
        # The span this plan holds for: the UTC day of t0, narrowed by every window's own
        # period (all of today's windows contain whole days).
        valid_from, valid_until = Period.DAY.start(t0), Period.DAY.end(t0)
        windows: dict[Window, tuple[str, datetime]] = {}  # each window's bucket computed once
        checks = tuple(self._located(t, f, stem, t0, windows) for t, f, stem in stems.entries)
        for window in windows:
            valid_from = max(valid_from, window.start(t0))
            valid_until = min(valid_until, window.end(t0))
        key_list = allow_field(identity.api_key) if identity.api_key is not None else ""
        plan = KeyPlan(
            identity.team,
            stems.policy_key,
            checks,
            (allow_field(None), key_list),
            stems.rate_fields,
            stems.rate_keys,
        )
        stems.plan, stems.valid_from, stems.valid_until = plan, valid_from, valid_until
        return plan

    def _parts(self, target: Target) -> tuple[str, str]:
        """What does not depend on time: the field, and the key name up to the bucket."""
        if isinstance(target, Balance):
            return BALANCE_FIELD, self.balance_key(target.team)
        return field_of(target), self._usage_stem(target)

    def _located(
        self,
        target: Target,
        field: str,
        stem: str,
        t0: datetime,
        windows: dict[Window, tuple[str, datetime]],
    ) -> Check:
        if isinstance(target, Balance):
            # No window: the key is reloaded from the ledger now and then instead, at the
            # latest a grace after the end of t0's UTC day (the span a cached plan holds for,
            # so a key filled from that plan still lives at least a grace).
            return Check(target, "", field, stem, Period.DAY.end(t0) + self.grace)
        window = target.window
        at = windows.get(window)
        if at is None:
            at = windows[window] = (window.bucket(t0), window.end(t0) + self.grace)
        return Check(target, at[0], field, stem + at[0], at[1])

    def _remember(self, identity: Identity) -> _Stems:
        if len(self._stems) >= self.MAX_CACHED_IDENTITIES:
            self._stems.clear()  # a bound, not an LRU: rebuilding is cheap, growing is not
        entries = tuple((t, *self._parts(t)) for t in applicable(identity))
        team, key = identity.team, identity.api_key
        team_rates = self.rate_key(team, None)
        stems = _Stems(
            self.policy_key(team),
            entries,
            ("" if key is None else rate_field(key), rate_field(None)),
            (team_rates if key is None else self.rate_key(team, key), team_rates),
        )
        self._stems[(identity.team, identity.api_key)] = stems
        return stems

    @staticmethod
    def policy_fields(
        policies: Iterable[Policy],
        *,
        balance: bool,
        balance_hard: bool = False,
        models: Mapping[str | None, Sequence[str]] | None = None,
        rates: Mapping[str | None, Rates] | None = None,
    ) -> dict[str, int | str]:
        """A team's policy hash: field -> amount (empty: "no policy"), plus the balance
        marker when the team has a prepaid account."""
        # A limit stored before amounts were bounded (or written to the table by hand) is
        # cached at the bound: above it no store script would take it, and every request of
        # the team would fail instead of being checked.
        fields: dict[str, int | str] = {}
        for p in policies:
            name = field_of(p.limit)
            prefix = (FIT_PREFIX if p.fit else HARD_PREFIX) if p.hard else ""
            fields[prefix + name] = min(p.amount, MAX_AMOUNT_MICROS)
            if p.alert_at is not None:
                fields[ALERT_PREFIX + name] = ",".join(map(str, p.alert_at))
        if balance:
            fields[(HARD_PREFIX if balance_hard else "") + BALANCE_FIELD] = 1
        for api_key, patterns in (models or {}).items():
            if patterns:
                fields[allow_field(api_key)] = encode_models(patterns)
        for api_key, subject_rates in (rates or {}).items():
            if not subject_rates.empty:
                fields[rate_field(api_key)] = subject_rates.encode()
        return fields
