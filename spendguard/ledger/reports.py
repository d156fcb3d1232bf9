"""Read-only reports for the CLI and admin tools: settled spend, charge totals, aggregates.

Nothing on the request path or in the worker reads these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..clock import to_micros
from ..limits import Limit, Period, Subject
from .database import LedgerDatabase, _tuples
from .policies import Aggregate, _limit_of
from .schema import aggregates, charges, charges_in, records


@dataclass(frozen=True, slots=True)
class SpendRow:
    """Settled spend (sum of charges, micro-USD) against ``limit`` in ``bucket``, whether or
    not a policy sets that limit. ``api_key_id`` is the raw id of a key row, for display."""

    limit: Limit
    api_key_id: str | None
    bucket: str
    spent: int


@dataclass(frozen=True, slots=True)
class TopRow:
    """One spender over a span: a team, an API key of a team, an end user of a team, a tag or
    a model (the other fields empty), with the estimated spend of its charged records and how
    many there were."""

    team: str  # encoded ids ("" for a model's or a tag's row)
    api_key: str
    team_id: str  # as the host app gave them (display)
    api_key_id: str | None
    model: str
    spent: int
    requests: int
    name: str = ""  # an end user's or a tag's row: the end user or the tag, as given


TOP_BY = ("team", "key", "model", "end_user", "tag", "customer")


class ReportQueries(LedgerDatabase):
    async def top_spenders(
        self, by: str, since: datetime, until: datetime, limit: int
    ) -> list[TopRow]:
        """The ``limit`` biggest spenders ``by`` team, key or model over [since, until): the
        postflight estimates of charged (2xx) records, settled or not, by start time."""
        if by not in TOP_BY:
            raise ValueError(f"by: one of {', '.join(TOP_BY)}")
        if by == "tag":
            return await self._top_tags(since, until, limit)
        r = records.c
        spent = sa.func.sum(r.estimate_micros)
        group: list[Any] = {
            "team": [r.team],
            "key": [r.team, r.api_key],
            "model": [r.model],
            "end_user": [r.team, r.end_user],
            "customer": [r.customer],
        }[by]
        names: list[Any] = {
            "team": [sa.func.max(r.team_id), sa.func.max(r.api_key_id)],
            "key": [sa.func.max(r.team_id), sa.func.max(r.api_key_id)],
            "model": [],
            "end_user": [sa.func.max(r.team_id), sa.func.max(r.end_user_id)],
            "customer": [sa.func.max(r.customer_id)],
        }[by]
        query = (
            sa.select(*group, *names, spent, sa.func.count())
            .where(
                r.t0_us >= to_micros(since),
                r.t0_us < to_micros(until),
                r.status_code >= 200,
                r.status_code < 300,
            )
            .group_by(*group)
            .order_by(spent.desc(), *group)
            .limit(limit)
        )
        if by == "key":
            query = query.where(r.api_key != "")
        if by == "end_user":
            query = query.where(r.end_user.is_not(None))
        if by == "customer":
            query = query.where(r.customer.is_not(None))
        async with self._guard("top spenders read"):
            rows = _tuples(await self._db.fetch_all(query))
        out: list[TopRow] = []
        for row in rows:
            if by == "team":
                team, team_id, _, total, n = row
                out.append(TopRow(str(team), "", str(team_id), None, "", int(total), int(n)))
            elif by == "key":
                team, key, team_id, key_id, total, n = row
                out.append(
                    TopRow(str(team), str(key), str(team_id), key_id, "", int(total), int(n))
                )
            elif by == "end_user":
                team, _, team_id, end_user_id, total, n = row
                out.append(
                    TopRow(str(team), "", str(team_id), None, "", int(total), int(n), end_user_id)
                )
            elif by == "customer":
                _, customer_id, total, n = row
                out.append(TopRow("", "", "", None, "", int(total), int(n), str(customer_id)))
            else:
                model, total, n = row
                out.append(TopRow("", "", "", None, str(model), int(total), int(n)))
        return out

    async def _top_tags(self, since: datetime, until: datetime, limit: int) -> list[TopRow]:
        """:meth:`top_spenders` by tag: a record counts for each tag it carries (so the rows
        add up to more than the spend: a request of two tags is in both)."""
        r = records.c
        query = sa.select(r.tag_ids, r.estimate_micros).where(
            r.t0_us >= to_micros(since),
            r.t0_us < to_micros(until),
            r.status_code >= 200,
            r.status_code < 300,
            r.tag_ids.is_not(None),
        )
        async with self._guard("top spenders read"):
            rows = _tuples(await self._db.fetch_all(query))
        totals: dict[str, list[int]] = {}
        for tag_ids, estimate in rows:
            for tag in json.loads(str(tag_ids)):
                entry = totals.setdefault(str(tag), [0, 0])
                entry[0] += int(estimate)
                entry[1] += 1
        ranked = sorted(totals.items(), key=lambda t: (-t[1][0], t[0]))[:limit]
        return [TopRow("", "", "", None, "", spent, n, tag) for tag, (spent, n) in ranked]

    async def spend(self, team: str, now: datetime) -> list[SpendRow]:
        """A team's settled spend in the day and the month containing ``now``: per API key
        that spent (in key order), then the team's total, the day's rows first."""
        rows: list[tuple[Subject, Period, str, int]] = []
        async with self._guard("usage read"):
            for window in (Period.DAY, Period.MONTH):
                bucket = window.bucket(now)
                per_key = await self._db.fetch_all(
                    sa.select(charges.c.api_key, sa.func.sum(charges.c.amount_micros))
                    .where(charges.c.team == team, *charges_in(window, now))
                    .group_by(charges.c.api_key)
                    .order_by(charges.c.api_key)
                )
                total = 0
                for key, amount in _tuples(per_key):
                    total += int(amount)
                    if key:
                        rows.append((Subject(team, key), window, bucket, int(amount)))
                rows.append((Subject(team), window, bucket, total))
            raw_ids = dict(
                _tuples(
                    await self._db.fetch_all(
                        sa.select(records.c.api_key, records.c.api_key_id)
                        .where(records.c.team == team)
                        .distinct()
                    )
                )
            )
        return [
            SpendRow(Limit(subject, window), raw_ids.get(subject.api_key or ""), bucket, spent)
            for subject, window, bucket, spent in rows
        ]

    async def recent_spend(self, team: str, now: datetime) -> dict[str, tuple[int, int]]:
        """Per API key of ``team`` (``""``: requests without one), the estimated spend of its
        charged records that started in the last hour and in the last 24 hours before
        ``now`` (micro-USD): what forecasts take the spend rate from."""
        now_us = to_micros(now)
        hour, day = now_us - 3_600_000_000, now_us - 86_400_000_000
        estimate = records.c.estimate_micros
        query = (
            sa.select(
                records.c.api_key,
                sa.func.sum(sa.case((records.c.t0_us >= hour, estimate), else_=0)),
                sa.func.sum(estimate),
            )
            .where(
                records.c.team == team,
                records.c.t0_us >= day,
                records.c.t0_us <= now_us,
                records.c.status_code >= 200,
                records.c.status_code < 300,
            )
            .group_by(records.c.api_key)
        )
        async with self._guard("recent spend read"):
            rows = await self._db.fetch_all(query)
        return {str(key): (int(h or 0), int(d or 0)) for key, h, d in _tuples(rows)}

    async def charges_total(self, team: str | None = None) -> int:
        """The sum of all charges (of one team, or everyone's), micro-USD."""
        query = sa.select(sa.func.coalesce(sa.func.sum(charges.c.amount_micros), 0))
        if team is not None:
            query = query.where(charges.c.team == team)
        async with self._guard("charge read"):
            return int(await self._db.fetch_val(query))

    async def aggregates(self, team: str | None = None) -> list[Aggregate]:
        """Every aggregate row (of one team, or everyone's), of any bucket, open or closed."""
        query = sa.select(
            aggregates.c.team,
            aggregates.c.api_key,
            aggregates.c.period,
            aggregates.c.period_id,
            aggregates.c.settled_micros,
        )
        if team is not None:
            query = query.where(aggregates.c.team == team)
        async with self._guard("aggregate read"):
            rows = await self._db.fetch_all(query)
        return [
            Aggregate(_limit_of(t, key, period), bucket, int(settled))
            for t, key, period, bucket, settled in _tuples(rows)
        ]
