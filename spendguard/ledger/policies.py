"""Policies (the limits operators set) and the settled spend aggregated against them.

A policy row is keyed by its limit's columns: ``team``, ``api_key`` ('' for a team limit) and
``period`` (the window's name). :func:`_limit_columns` and :func:`_limit_of` are the only
places that map a :class:`Limit` to those columns and back. Each active limit has one
aggregate row per bucket of its window: the settled spend counted against it there.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..clock import to_micros, utcnow
from ..limits import Limit, Period, Policy, Subject, window_of
from ..limits.rates import MAX_RATE, Rates
from .balances import Account, BalanceQueries
from .database import _text, _tuples
from .schema import aggregates, balances, charges, charges_in, model_access, policies, rates


@dataclass(frozen=True, slots=True)
class Aggregate:
    """The settled spend counted against ``limit`` in one bucket of its window, micro-USD."""

    limit: Limit
    bucket: str
    settled: int


def _limit_columns(limit: Limit) -> dict[str, str]:
    """The key columns of ``limit``'s rows (policies and aggregates)."""
    return {
        "team": limit.team,
        "api_key": limit.subject.api_key or "",
        "period": limit.window.value,
    }


def _limit_of(team: str, api_key: str, period: str) -> Limit:
    """The limit of a row's key columns; ValueError for a window name spendguard can't read."""
    return Limit(Subject(team, api_key or None), window_of(period))


def _policy_of(m: Any) -> Policy:
    return Policy(
        limit=_limit_of(m["team"], m["api_key"], m["period"]),
        amount=int(m["limit_micros"]),
        team_id=m["team_id"],
        api_key_id=m["api_key_id"],
        hard=bool(m["hard"]),
        alert_at=_alert_at(m["alert_at"]),
        fit=bool(m["fit"]),
    )


def _alert_at(text: str | None) -> tuple[int, ...] | None:
    """A row's alert_at column: None (the default), or its percentages (a value written by
    hand that is not one reads as none)."""
    if text is None:
        return None
    return tuple(int(p) for p in text.split(",") if p.isdigit())


def _alert_text(alert_at: tuple[int, ...] | None) -> str | None:
    return None if alert_at is None else ",".join(map(str, alert_at))


class PolicyQueries(BalanceQueries):
    async def set_policy(
        self, policy: Policy, *, now: datetime | None = None, keep_alerts: bool = False
    ) -> Policy:
        """Create, change or reactivate a policy.

        A new or reactivated policy's current-window aggregate is rebuilt from that window's
        charges in the same transaction, so spend that happened before the policy existed
        counts against it exactly once. Changing the amount of an active policy keeps it.
        ``keep_alerts``: an existing policy keeps its alert thresholds (``policy.alert_at`` is
        ignored); returns the policy as stored.
        """
        if policy.amount < 0:
            raise ValueError("limit must be >= 0")
        now = now or utcnow()
        now_us = to_micros(now)
        limit = policy.limit
        cols = _limit_columns(limit)
        async with self._guard("policy write"), self._db.transaction():
            await self._lock_for_write()
            await self._lock_teams([limit.team])
            existing = await self._db.fetch_one(
                sa.select(policies.c.active, policies.c.alert_at).where(
                    *(policies.c[name] == value for name, value in cols.items())
                )
            )
            if keep_alerts:
                kept = None if existing is None else _alert_at(existing[1])
                policy = dataclasses.replace(policy, alert_at=kept)
            stmt = self._insert(policies).values(
                **cols,
                team_id=_text(policy.team_id),
                api_key_id=_text(policy.api_key_id),
                limit_micros=policy.amount,
                active=True,
                hard=policy.hard,
                fit=policy.hard and policy.fit,
                alert_at=_alert_text(policy.alert_at),
                created_us=now_us,
                updated_us=now_us,
            )
            stmt = stmt.on_conflict_do_update(
                index_elements=[policies.c.team, policies.c.api_key, policies.c.period],
                set_={
                    "limit_micros": stmt.excluded.limit_micros,
                    "active": True,
                    "hard": stmt.excluded.hard,
                    "fit": stmt.excluded.fit,
                    "alert_at": stmt.excluded.alert_at,
                    "updated_us": stmt.excluded.updated_us,
                },
            )
            await self._db.execute(stmt)
            if existing is None or not existing[0]:
                await self._rebuild_aggregate(limit, now, now_us)
        return policy

    async def _rebuild_aggregate(self, limit: Limit, now: datetime, now_us: int) -> None:
        """Set ``limit``'s aggregate in the bucket of ``now`` to the sum of the charges it
        covers."""
        bucket = limit.window.bucket(now)
        conds = [charges.c.team == limit.team, *charges_in(limit.window, now)]
        if limit.subject.api_key is not None:
            conds.append(charges.c.api_key == limit.subject.api_key)
        total = await self._db.fetch_val(
            sa.select(sa.func.coalesce(sa.func.sum(charges.c.amount_micros), 0)).where(*conds)
        )
        stmt = self._insert(aggregates).values(
            **_limit_columns(limit),
            period_id=bucket,
            settled_micros=int(total),
            updated_us=now_us,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[
                aggregates.c.team,
                aggregates.c.api_key,
                aggregates.c.period,
                aggregates.c.period_id,
            ],
            set_={"settled_micros": stmt.excluded.settled_micros, "updated_us": now_us},
        )
        await self._db.execute(stmt)

    async def remove_policy(self, limit: Limit) -> bool:
        """Deactivate a policy (kept for history); returns whether an active one existed."""
        match = [policies.c[name] == value for name, value in _limit_columns(limit).items()]
        async with self._guard("policy write"):
            row = await self._db.fetch_one(sa.select(policies.c.active).where(*match))
            if row is None or not row[0]:
                return False
            await self._db.execute(
                policies.update().where(*match).values(active=False, updated_us=to_micros(utcnow()))
            )
            return True

    async def list_policies(self, team: str | None = None) -> list[Policy]:
        """Active policies (of one team, or all), ordered by team, API key and window."""
        query = sa.select(policies).where(policies.c.active == sa.true())
        if team is not None:
            query = query.where(policies.c.team == team)
        query = query.order_by(policies.c.team, policies.c.api_key, policies.c.period)
        async with self._guard("policy read"):
            rows = await self._db.fetch_all(query)
        return [_policy_of(r._mapping) for r in rows]

    async def load_limits(self, team: str) -> tuple[list[Policy], Account | None]:
        """What a cache miss needs of a team: its active policies (empty: no limit) and its
        prepaid account (None: not balance-limited)."""
        return await self.list_policies(team), await self.load_balance(team)

    async def load_aggregates(
        self, team: str, wanted: Iterable[tuple[Limit, str]]
    ) -> dict[tuple[Limit, str], int]:
        """Settled micro-USD of ``team``'s limits in the given buckets; 0 where no row exists."""
        wanted = list(wanted)
        if not wanted:
            return {}
        if any(limit.team != team for limit, _ in wanted):
            raise ValueError(f"load_aggregates: every limit must be of team {team!r}")
        conds = []
        for limit, bucket in wanted:
            cols = _limit_columns(limit)
            conds.append(
                sa.and_(
                    aggregates.c.api_key == cols["api_key"],
                    aggregates.c.period == cols["period"],
                    aggregates.c.period_id == bucket,
                )
            )
        query = sa.select(
            aggregates.c.api_key,
            aggregates.c.period,
            aggregates.c.period_id,
            aggregates.c.settled_micros,
        ).where(aggregates.c.team == team, sa.or_(*conds))
        async with self._guard("aggregate read"):
            rows = await self._db.fetch_all(query)
        found = {
            (_limit_of(team, key, period), bucket): int(settled)
            for key, period, bucket, settled in _tuples(rows)
        }
        return {w: found.get(w, 0) for w in wanted}

    async def policy_aggregates(
        self, now: datetime, teams: Sequence[str] | None = None
    ) -> dict[str, list[Aggregate]]:
        """For every team with active policies (or just ``teams``): each active limit's
        aggregate in the bucket of its window containing ``now``, 0 where no row exists yet.
        The worker's self-healing refresh rewrites the cache from these."""
        # Each policy joins the aggregate row of its own window's current bucket.
        current = sa.case(*((policies.c.period == w.value, w.bucket(now)) for w in Period))
        query = (
            sa.select(
                policies.c.team,
                policies.c.api_key,
                policies.c.period,
                aggregates.c.settled_micros,
            )
            .select_from(
                policies.outerjoin(
                    aggregates,
                    sa.and_(
                        aggregates.c.team == policies.c.team,
                        aggregates.c.api_key == policies.c.api_key,
                        aggregates.c.period == policies.c.period,
                        aggregates.c.period_id == current,
                    ),
                )
            )
            .where(policies.c.active == sa.true())
        )
        if teams is not None:
            query = query.where(policies.c.team.in_(list(teams)))
        async with self._guard("aggregate read"):
            rows = await self._db.fetch_all(query)
        out: dict[str, list[Aggregate]] = defaultdict(list)
        for team, key, period, settled in _tuples(rows):
            limit = _limit_of(team, key, period)
            out[team].append(Aggregate(limit, limit.window.bucket(now), int(settled or 0)))
        return dict(out)

    async def set_models(
        self,
        team: str,
        api_key: str | None,
        *,
        team_id: str,
        api_key_id: str | None,
        patterns: Iterable[str],
        allowed: bool = True,
        now: datetime | None = None,
    ) -> None:
        """Allow (or, ``allowed=False``, stop allowing) model patterns for a key or a team."""
        now_us = to_micros(now or utcnow())
        async with self._guard("model access write"), self._db.transaction():
            for pattern in dict.fromkeys(patterns):
                stmt = self._insert(model_access).values(
                    team=team,
                    api_key=api_key or "",
                    pattern=pattern,
                    team_id=_text(team_id),
                    api_key_id=_text(api_key_id),
                    active=allowed,
                    updated_us=now_us,
                )
                await self._db.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[
                            model_access.c.team,
                            model_access.c.api_key,
                            model_access.c.pattern,
                        ],
                        set_={"active": allowed, "updated_us": now_us},
                    )
                )

    async def load_models(self, team: str) -> dict[str | None, list[str]]:
        """The team's allowed model patterns: per API key, and under None for the team."""
        query = (
            sa.select(model_access.c.api_key, model_access.c.pattern)
            .where(model_access.c.team == team, model_access.c.active == sa.true())
            .order_by(model_access.c.api_key, model_access.c.pattern)
        )
        async with self._guard("model access read"):
            rows = _tuples(await self._db.fetch_all(query))
        out: dict[str | None, list[str]] = {}
        for key, pattern in rows:
            out.setdefault(key or None, []).append(pattern)
        return out

    async def set_rates(
        self,
        team: str,
        api_key: str | None,
        *,
        team_id: str,
        api_key_id: str | None,
        value: Rates,
        now: datetime | None = None,
    ) -> None:
        """Set a key's (or, with None, the team's) rates; empty :class:`Rates` removes them."""
        now_us = to_micros(now or utcnow())
        row = {
            "rpm": value.rpm,
            "tpm": value.tpm,
            "max_parallel": value.max_parallel,
            "active": not value.empty,
            "updated_us": now_us,
        }
        stmt = self._insert(rates).values(
            team=team,
            api_key=api_key or "",
            team_id=_text(team_id),
            api_key_id=_text(api_key_id),
            **row,
        )
        async with self._guard("rates write"):
            await self._db.execute(
                stmt.on_conflict_do_update(index_elements=[rates.c.team, rates.c.api_key], set_=row)
            )

    async def load_rates(self, team: str) -> dict[str | None, Rates]:
        """The team's rates: per encoded API key, and under None for the team."""
        query = sa.select(rates.c.api_key, rates.c.rpm, rates.c.tpm, rates.c.max_parallel).where(
            rates.c.team == team, rates.c.active == sa.true()
        )
        async with self._guard("rates read"):
            rows = _tuples(await self._db.fetch_all(query))
        return {key or None: _rates(rpm, tpm, par) for key, rpm, tpm, par in rows}

    async def list_rates(self, team: str) -> dict[str | None, tuple[str | None, Rates]]:
        """Like :meth:`load_rates`, with each key's raw id for display."""
        query = (
            sa.select(
                rates.c.api_key, rates.c.api_key_id, rates.c.rpm, rates.c.tpm, rates.c.max_parallel
            )
            .where(rates.c.team == team, rates.c.active == sa.true())
            .order_by(rates.c.api_key)
        )
        async with self._guard("rates read"):
            rows = _tuples(await self._db.fetch_all(query))
        return {key or None: (key_id, _rates(rpm, tpm, par)) for key, key_id, rpm, tpm, par in rows}

    async def policies_changed_since(self, since_us: int) -> dict[str, int]:
        """Teams whose policies changed at or after ``since_us`` (by anyone, e.g. the CLI),
        with the time of their latest change."""
        query = (
            sa.select(policies.c.team, sa.func.max(policies.c.updated_us))
            .where(policies.c.updated_us >= since_us)
            .group_by(policies.c.team)
        )
        # An account opened, topped up or switched hard/soft, model lists or rates changed: the
        # cached policy hash holds all of them.
        accounts = sa.select(balances.c.team, balances.c.updated_us).where(
            balances.c.updated_us >= since_us
        )
        models = (
            sa.select(model_access.c.team, sa.func.max(model_access.c.updated_us))
            .where(model_access.c.updated_us >= since_us)
            .group_by(model_access.c.team)
        )
        rated = (
            sa.select(rates.c.team, sa.func.max(rates.c.updated_us))
            .where(rates.c.updated_us >= since_us)
            .group_by(rates.c.team)
        )
        async with self._guard("policy read"):
            rows = _tuples(await self._db.fetch_all(query))
            rows += _tuples(await self._db.fetch_all(accounts))
            rows += _tuples(await self._db.fetch_all(models))
            rows += _tuples(await self._db.fetch_all(rated))
        changed: dict[str, int] = {}
        for team, at in rows:
            changed[team] = max(changed.get(team, 0), int(at))
        return changed


def _rates(*values: object) -> Rates:
    """A row's rates. One written some other way (by hand) is read within the bounds: 0 or
    less is no rate, above :data:`MAX_RATE` the bound, so every request is still checked."""
    rpm, tpm, par = (
        None if v is None or int(str(v)) <= 0 else min(int(str(v)), MAX_RATE) for v in values
    )
    return Rates(rpm, tpm, par)
