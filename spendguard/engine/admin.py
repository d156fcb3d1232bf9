"""The admin API: policies, balances and usage, kept in sync with the cache (design.md,
"Admin changes").

This is what the ``spendguard`` CLI sits on, and what a gateway's own admin endpoints call::

    admin = guard.admin                      # in the gateway: this process's cache included
    await admin.set_policy("acme", window="month", limit_usd="100")
    report = await admin.usage("acme")

Every change is written to the ledger first; then the cached policy is dropped (and the usage
key of a newly active limit raised to its rebuilt aggregate), so the change applies to the
next request. With Redis that is every replica at once; an embedded store elsewhere learns of
it on its next settlement pass. A cache that can't be reached is logged, never an error: the
ledger is the truth and the cached policy expires by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from ..alerts.events import Alert
from ..alerts.thresholds import parse_thresholds
from ..clock import utcnow
from ..errors import StoreUnavailable
from ..identity import Identity
from ..ledger import Account, DenialRow, Ledger, TopRow
from ..limits import Balance, KeyCodec, Limit, Period, Policy, Subject, Window, window_of
from ..limits.models import check_pattern
from ..limits.rates import Rates
from ..money import MAX_TOTAL_MICROS, checked_amount, micros_to_usd, usd_to_micros
from ..store import CachedParts, RefreshEntry, Store
from .forecast import Forecast, forecast

log = logging.getLogger("spendguard.admin")


@dataclass(frozen=True, slots=True)
class LimitUsage:
    """Spend of one subject in one current window, with its limit if it has one."""

    limit: Limit
    api_key_id: str | None  # the raw key id, for display (None for the team)
    bucket: str
    settled: int  # settled charges in the window, micro-USD
    amount: int | None  # the limit; None: no limit set
    aggregate: int | None  # the ledger's running total for the limit (None: no row yet)
    cached: int | None  # settled + pending in the cache; None when not readable here
    resets_at: datetime
    parts: CachedParts | None = None  # the cache's settled, pending and held parts
    forecast: Forecast | None = None  # at the recent spend rate (see engine/forecast.py)

    @property
    def used(self) -> int:
        """Best known usage: the cache's (it includes pending estimates), else settled."""
        return self.cached if self.cached is not None else self.settled

    @property
    def remaining(self) -> int | None:
        return None if self.amount is None else max(0, self.amount - self.used)


@dataclass(frozen=True, slots=True)
class UsageReport:
    team_id: str
    at: datetime
    limits: tuple[LimitUsage, ...]
    charges_total: int  # every settled charge of the team, all time
    unsettled_records: int
    unsettled_estimate: int
    cache_error: str | None = None  # the cache could not be read (values then None)


@dataclass(frozen=True, slots=True)
class BalanceReport:
    team_id: str
    account: Account
    unsettled_records: int
    unsettled_estimate: int
    cached_used: int | None  # charged + pending in the cache; None when not readable here

    @property
    def remaining(self) -> int:
        """What is left: topped up minus the best known usage."""
        used = self.cached_used if self.cached_used is not None else self.account.charged
        return self.account.topped_up - used


def _forecast(row: LimitUsage, recent: tuple[int, int], now: datetime) -> LimitUsage:
    found = forecast(row.used, row.amount, *recent, now, row.resets_at)
    return dataclasses.replace(row, forecast=found)


@dataclass(frozen=True, slots=True)
class Spender:
    """One of the top spenders of a period: its spend, and for a team or a key its limit for
    the period (None: none set), what is left, when it resets and where it is heading."""

    row: TopRow
    amount: int | None
    resets_at: datetime
    forecast: Forecast | None
    denied_last_hour: int = 0  # requests of this team or key refused in the last hour

    @property
    def remaining(self) -> int | None:
        return None if self.amount is None else max(0, self.amount - self.row.spent)


@dataclass(frozen=True, slots=True)
class TopReport:
    by: str  # team | key | model
    period: Period
    period_id: str
    at: datetime
    spenders: tuple[Spender, ...]


class Admin:
    """``store`` is the cache to keep in sync, or None when it is out of reach (a CLI next
    to gateways with embedded stores)."""

    def __init__(
        self,
        ledger: Ledger,
        store: Store | None,
        codec: KeyCodec,
        *,
        policy_ttl: float = 60.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.ledger = ledger
        self.store = store
        self.codec = codec
        self.policy_ttl = policy_ttl
        self.clock = clock

    # -- policies -------------------------------------------------------------------------
    async def set_policy(
        self,
        team_id: str,
        api_key_id: str | None = None,
        *,
        window: Window | str,
        limit_usd: Decimal | str | int,
        hard: bool = False,
        alert_at: Iterable[int] | str | None = None,
        fit: bool = False,
    ) -> Policy:
        """Create or change a limit (0 blocks everything); ValueError on a bad argument.

        ``hard``: a request is admitted only if its worst-case cost fits under the limit (held
        until it ends); soft (the default): admitted while usage is below it. ``fit`` (hard
        only): a request whose output cap doesn't fit is fitted to what is left instead of
        refused, when the gateway fits at all (``SPENDGUARD_FIT_MIN_OUTPUT_TOKENS``).

        ``alert_at``: the limit's own alert thresholds, percentages (``[50, 80, 100]`` or
        ``"50,80,100"``) that alert once per window; ``[]`` or ``""``: this limit never
        alerts; ``"default"``: back to the gateway's ``SPENDGUARD_ALERT_THRESHOLDS``; None
        (the default): a limit keeps what it has (a new one: the gateway's)."""
        if fit and not hard:
            raise ValueError("fit applies to a hard limit only")
        identity = Identity(team_id, api_key_id)
        limit = Limit(Subject(identity.team, identity.api_key), _window(window))
        amount = checked_amount(usd_to_micros(limit_usd), "a limit", allow_zero=True)
        own = None if alert_at is None or alert_at == "default" else parse_thresholds(alert_at)
        now = self.clock()
        policy = await self.ledger.set_policy(
            Policy(
                limit,
                amount,
                identity.team_id,
                identity.api_key_id,
                hard=hard,
                alert_at=own,
                fit=fit,
            ),
            now=now,
            keep_alerts=alert_at is None,
        )
        await self._sync(limit.team, "policy saved", activated=(limit, limit.window.bucket(now)))
        return policy

    async def remove_policy(
        self, team_id: str, api_key_id: str | None = None, *, window: Window | str
    ) -> bool:
        """Deactivate a limit (kept for history); False when no active one existed."""
        identity = Identity(team_id, api_key_id)
        limit = Limit(Subject(identity.team, identity.api_key), _window(window))
        removed = await self.ledger.remove_policy(limit)
        await self._sync(limit.team, "policy removed")
        return removed

    # -- model access ---------------------------------------------------------------------
    async def allow_models(
        self, team_id: str, api_key_id: str | None, patterns: Sequence[str], *, allowed: bool = True
    ) -> dict[str | None, list[str]]:
        """Add model names or globs (``gpt-4o*``) to the list of a key (or, with no key, of
        the team); ``allowed=False`` takes them off. A request must match every list that
        applies to it (its key's and its team's); no list: any model. Returns the team's lists
        (by API key id, None for the team). ValueError on a bad id or pattern."""
        identity = Identity(team_id, api_key_id)
        if not patterns:
            raise ValueError("name at least one model or pattern")
        checked = [check_pattern(p) for p in patterns]
        await self.ledger.set_models(
            identity.team,
            identity.api_key,
            team_id=identity.team_id,
            api_key_id=identity.api_key_id,
            patterns=checked,
            allowed=allowed,
            now=self.clock(),
        )
        await self._sync(identity.team, "model list saved")
        return await self.list_models(team_id)

    async def list_models(self, team_id: str) -> dict[str | None, list[str]]:
        """The team's model lists: by encoded API key (None: the team's own list)."""
        return await self.ledger.load_models(Identity(team_id).team)

    # -- rates ----------------------------------------------------------------------------
    async def set_rates(
        self,
        team_id: str,
        api_key_id: str | None = None,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        max_parallel: int | None = None,
    ) -> Rates:
        """Set the request rates of a key (or, with no key, of the team): requests and tokens
        per minute, requests in flight. A rate not given keeps its value; 0 removes it.
        Returns the subject's rates now. ValueError on a bad id or rate."""
        identity = Identity(team_id, api_key_id)
        current = (await self.ledger.load_rates(identity.team)).get(identity.api_key, Rates())

        def merged(given: int | None, kept: int | None) -> int | None:
            return kept if given is None else (given or None)

        value = Rates(
            merged(rpm, current.rpm),
            merged(tpm, current.tpm),
            merged(max_parallel, current.max_parallel),
        )
        await self._save_rates(identity, value, "rates saved")
        return value

    async def remove_rates(self, team_id: str, api_key_id: str | None = None) -> bool:
        """Remove every rate of a key (or the team); False when it had none."""
        identity = Identity(team_id, api_key_id)
        had = identity.api_key in await self.ledger.load_rates(identity.team)
        if had:
            await self._save_rates(identity, Rates(), "rates removed")
        return had

    async def list_rates(self, team_id: str) -> dict[str | None, Rates]:
        """The team's rates: by raw API key id (None: the team's own)."""
        listed = await self.ledger.list_rates(Identity(team_id).team)
        return {key_id if key else None: value for key, (key_id, value) in listed.items()}

    async def _save_rates(self, identity: Identity, value: Rates, what: str) -> None:
        await self.ledger.set_rates(
            identity.team,
            identity.api_key,
            team_id=identity.team_id,
            api_key_id=identity.api_key_id,
            value=value,
            now=self.clock(),
        )
        await self._sync(identity.team, what)

    async def top_spenders(
        self, by: str = "team", period: Period = Period.DAY, limit: int = 10
    ) -> TopReport:
        """Who spends most in the current UTC ``period``: teams, keys of teams, or models,
        biggest first. A team's or key's row carries its limit for the period and a forecast;
        spend is the postflight estimate of charged records, settled or not."""
        if not 1 <= limit <= 1000:
            raise ValueError("limit: 1 to 1000 spenders")
        now = self.clock()
        rows = await self.ledger.top_spenders(by, period.start(now), period.end(now), limit)
        amounts = {p.limit: p.amount for p in await self.ledger.list_policies()}
        denied = await self.ledger.denial_counts(since=now - timedelta(hours=1))
        recent: dict[str, dict[str, tuple[int, int]]] = {}
        out: list[Spender] = []
        for row in rows:
            if by in ("model", "end_user", "tag", "customer"):  # no limit of its own here
                out.append(Spender(row, None, period.end(now), None))
                continue
            if row.team not in recent:
                recent[row.team] = await self.ledger.recent_spend(row.team, now)
            spent = recent[row.team]
            if row.api_key:
                target = Limit(Subject(row.team, row.api_key), period)
                h_d = spent.get(row.api_key, (0, 0))
                refused = denied.get((row.team, row.api_key), 0)
            else:
                target = Limit(Subject(row.team), period)
                h_d = (sum(h for h, _ in spent.values()), sum(d for _, d in spent.values()))
                refused = sum(n for (team, _), n in denied.items() if team == row.team)
            amount = amounts.get(target)
            resets = period.end(now)
            heading = forecast(row.spent, amount, *h_d, now, resets)
            out.append(Spender(row, amount, resets, heading, refused))
        return TopReport(by, period, period.bucket(now), now, tuple(out))

    async def recent_denials(self, limit: int = 20) -> list[DenialRow]:
        """The newest denials of the last week (who, by what, which model), newest first."""
        if not 1 <= limit <= 1000:
            raise ValueError("limit: 1 to 1000 denials")
        return await self.ledger.recent_denials(since=self.clock() - timedelta(days=7), limit=limit)

    async def alerts(self, limit: int = 50) -> list[tuple[Alert, datetime | None, int]]:
        """The newest threshold alerts, each with when a receiver took it (None: not yet) and
        its delivery attempts."""
        if not 1 <= limit <= 1000:
            raise ValueError("limit: 1 to 1000 alerts")
        return await self.ledger.recent_alerts(limit)

    async def list_policies(self, team_id: str | None = None) -> list[Policy]:
        team = None if team_id is None else Identity(team_id).team
        return await self.ledger.list_policies(team)

    # -- balances -------------------------------------------------------------------------
    async def topup(self, team_id: str, usd: Decimal | str | int) -> Account:
        """Add prepaid credit (the first top-up opens the account); ValueError if not > 0."""
        identity = Identity(team_id)
        micros = checked_amount(usd_to_micros(usd), "a top-up", allow_zero=False)
        current = await self.ledger.load_balance(identity.team)
        if current is not None and current.topped_up + micros > MAX_TOTAL_MICROS:
            raise ValueError(
                f"top-ups of team {team_id!r} would exceed "
                f"{micros_to_usd(MAX_TOTAL_MICROS):,.0f} USD in all"
            )
        account = await self.ledger.topup(
            team=identity.team, team_id=identity.team_id, micros=micros, now=self.clock()
        )
        # A first top-up opens the account: the cached policy hash must learn of it.
        await self._sync(identity.team, "top-up saved", account=account)
        return account

    async def set_balance_mode(self, team_id: str, *, hard: bool) -> Account:
        """Make a team's prepaid account hard (a request is admitted only if its worst case
        fits what is left, held until it ends) or soft; ValueError when it has no account."""
        identity = Identity(team_id)
        account = await self.ledger.set_balance_mode(identity.team, hard=hard)
        if account is None:
            raise ValueError(f"team {team_id!r} has no balance account (top it up first)")
        await self._sync(identity.team, "balance mode saved")
        return account

    async def balance(self, team_id: str) -> BalanceReport | None:
        """The team's account, or None when it has none (not balance-limited)."""
        identity = Identity(team_id)
        account = await self.ledger.load_balance(identity.team)
        if account is None:
            return None
        count, estimates = await self.ledger.unsettled(identity.team)
        cached = None
        if self.store is not None:
            key = self.codec.usage_key(Balance(identity.team), "")
            with contextlib.suppress(StoreUnavailable):
                cached = (await self.store.read_usage([key]))[key]
        return BalanceReport(identity.team_id, account, count, estimates, cached)

    # -- usage ----------------------------------------------------------------------------
    async def usage(self, team_id: str, api_key_id: str | None = None) -> UsageReport:
        """Settled spend of the team and each key (or only ``api_key_id``) in the current
        day and month, each with its limit, what remains and when it resets."""
        identity = Identity(team_id, api_key_id)
        team = identity.team
        now = self.clock()
        spend = await self.ledger.spend(team, now)
        policies = {p.limit: p for p in await self.ledger.list_policies(team)}
        aggregates = {(a.limit, a.bucket): a.settled for a in await self.ledger.aggregates(team)}
        count, estimates = await self.ledger.unsettled(team)
        rows = [(s.limit, s.api_key_id, s.bucket, s.spent) for s in spend]
        # Limits with no spend yet still show, at 0.
        seen = {limit for limit, *_ in rows}
        rows += [
            (limit, p.api_key_id, limit.window.bucket(now), 0)
            for limit, p in policies.items()
            if limit not in seen
        ]
        if identity.api_key is not None:
            rows = [r for r in rows if r[0].subject.api_key in (None, identity.api_key)]
        cached, error = await self._cached(
            [(limit, bucket) for limit, _, bucket, _ in rows if limit in policies]
        )
        parts = (
            await self._parts([(limit, bucket) for limit, _, bucket, _ in rows]) if cached else {}
        )
        recent = await self.ledger.recent_spend(team, now)
        team_recent = (sum(h for h, _ in recent.values()), sum(d for _, d in recent.values()))
        limits = tuple(
            _forecast(
                LimitUsage(
                    limit=limit,
                    api_key_id=key_id if limit.subject.api_key is not None else None,
                    bucket=bucket,
                    settled=settled,
                    amount=policies[limit].amount if limit in policies else None,
                    aggregate=aggregates.get((limit, bucket)),
                    cached=cached.get((limit, bucket)),
                    resets_at=limit.window.end(now),
                    parts=parts.get((limit, bucket)),
                ),
                team_recent
                if limit.subject.api_key is None
                else recent.get(limit.subject.api_key, (0, 0)),
                now,
            )
            for limit, key_id, bucket, settled in rows
        )
        return UsageReport(
            team_id=identity.team_id,
            at=now,
            limits=limits,
            charges_total=await self.ledger.charges_total(team),
            unsettled_records=count,
            unsettled_estimate=estimates,
            cache_error=error,
        )

    async def _cached(
        self, wanted: list[tuple[Limit, str]]
    ) -> tuple[dict[tuple[Limit, str], int], str | None]:
        if self.store is None or not wanted:
            return {}, None
        keys = {w: self.codec.usage_key(*w) for w in wanted}
        try:
            values = await self.store.read_usage(list(keys.values()))
        except StoreUnavailable as exc:
            return {}, str(exc)
        found = {w: values[key] for w, key in keys.items()}
        return {w: v for w, v in found.items() if v is not None}, None

    async def _parts(self, wanted: list[tuple[Limit, str]]) -> dict[tuple[Limit, str], CachedParts]:
        if self.store is None or not wanted:
            return {}
        keys = {w: self.codec.usage_key(*w) for w in wanted}
        try:
            values = await self.store.read_parts(list(keys.values()))
        except StoreUnavailable:
            return {}
        return {w: v for w, key in keys.items() if (v := values[key]) is not None}

    # -- cache sync -----------------------------------------------------------------------
    async def _sync(
        self,
        team: str,
        what: str,
        *,
        activated: tuple[Limit, str] | None = None,
        account: Account | None = None,
    ) -> None:
        """Drop the team's cached policy; raise a (re)activated limit's usage key to the
        aggregate the ledger just rebuilt (the key may outlive a removed policy, stale); put
        a topped-up account into the balance key. Keys that don't exist stay absent."""
        if self.store is None:
            return
        try:
            await self.store.evict_policy(self.codec.policy_key(team))
            if activated is not None:
                agg = (await self.ledger.load_aggregates(team, [activated]))[activated]
                key = self.codec.usage_key(*activated)
                await self.store.refresh([RefreshEntry(key, agg)])
            if account is not None:
                key = self.codec.usage_key(Balance(team), "")
                await self.store.refresh(
                    [RefreshEntry(key, account.charged, limit=account.topped_up)]
                )
        except StoreUnavailable as exc:
            log.warning(
                "%s, cache not updated (%s); the cached policy expires in %gs",
                what,
                exc,
                self.policy_ttl,
            )


def _window(window: Window | str) -> Window:
    return window if isinstance(window, Period) else window_of(window)
