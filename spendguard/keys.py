"""Cache key names (R4.1) and the plan of keys one request touches.

    {prefix}:{team}:spend:policy
    {prefix}:{team}:spend:usage:team:month:YYYYMM
    {prefix}:{team}:spend:usage:team:day:YYYYMMDD
    {prefix}:{team}:spend:usage:api_key:<key>:day:YYYYMMDD
    {prefix}:{team}:spend:usage:api_key:<key>:month:YYYYMM

``team`` and ``key`` are encoded ids (:func:`spendguard.identity.encode_id`), so every key of
one request hashes to the team's cluster slot and no id can reach outside its segment.
Policy hash fields name the scope without the prefix: ``team:month``, ``api_key:<key>:day``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from .identity import Identity
from .periods import Period, period_end, period_id

# Marks a policy hash as loaded from the ledger, so a missing field means "no policy" (negative
# caching) instead of "not loaded yet".
LOADED_FIELD = "_loaded"


class Scope(StrEnum):
    TEAM = "team"
    API_KEY = "api_key"
    BALANCE = "balance"  # the team's prepaid account: no period


# The policy-hash field saying the team has a balance account (its value is "1"). The balance
# itself lives in the balance key: t (topped up), s (settled charges), p (pending estimates).
BALANCE_FIELD = "balance"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One limit a request may be subject to: its policy field and the usage key of t0's period."""

    scope: Scope
    period: Period | None  # None for the balance
    period_id: str
    field: str
    usage_key: str
    expires_at: datetime  # period end + settlement grace: a closed period's key outlives it


@dataclass(frozen=True, slots=True)
class KeyPlan:
    team: str
    policy_key: str
    candidates: tuple[Candidate, ...]  # in the order limits are checked: narrowest first


def policy_field(scope: Scope, period: Period, api_key: str | None) -> str:
    if scope is Scope.TEAM:
        return f"team:{period.value}"
    if api_key is None:
        raise ValueError("an api_key policy needs an api key")
    return f"api_key:{api_key}:{period.value}"


def policy_key(prefix: str, team: str) -> str:
    return f"{prefix}:{{{team}}}:spend:policy"


def usage_key(prefix: str, team: str, field: str, pid: str) -> str:
    return f"{prefix}:{{{team}}}:spend:usage:{field}:{pid}"


def balance_key(prefix: str, team: str) -> str:
    return f"{prefix}:{{{team}}}:spend:balance"


def plan(prefix: str, identity: Identity, t0: datetime, grace: timedelta) -> KeyPlan:
    """Every limit that may apply to ``identity`` at ``t0`` (the store skips unset ones)."""
    scopes: list[tuple[Scope, Period]] = []
    if identity.api_key is not None:
        scopes += [(Scope.API_KEY, Period.DAY), (Scope.API_KEY, Period.MONTH)]
    scopes += [(Scope.TEAM, Period.DAY), (Scope.TEAM, Period.MONTH)]
    candidates = []
    for scope, period in scopes:
        field = policy_field(scope, period, identity.api_key)
        pid = period_id(period, t0)
        candidates.append(
            Candidate(
                scope=scope,
                period=period,
                period_id=pid,
                field=field,
                usage_key=usage_key(prefix, identity.team, field, pid),
                expires_at=period_end(period, t0) + grace,
            )
        )
    # Checked last: a spend limit names the narrower problem when both apply.
    candidates.append(
        Candidate(
            scope=Scope.BALANCE,
            period=None,
            period_id="",
            field=BALANCE_FIELD,
            usage_key=balance_key(prefix, identity.team),
            expires_at=t0 + grace,  # no period: reloaded from the ledger now and then
        )
    )
    return KeyPlan(
        team=identity.team,
        policy_key=policy_key(prefix, identity.team),
        candidates=tuple(candidates),
    )


def parse_field(field: str) -> tuple[Scope, str | None, Period] | None:
    """Inverse of :func:`policy_field`; None for the loaded marker or anything unknown."""
    parts = field.split(":")
    try:
        if len(parts) == 2 and parts[0] == Scope.TEAM:
            return Scope.TEAM, None, Period(parts[1])
        if len(parts) == 3 and parts[0] == Scope.API_KEY:
            return Scope.API_KEY, parts[1], Period(parts[2])
    except ValueError:
        return None
    return None
