"""Moving fired alerts into the outbox, and delivering what the outbox holds.

Off the request path: the postflight that fired an alert only tells :meth:`AlertService.note`
its team. Each pass (:meth:`AlertService.run_once`) moves the alerts of the noted teams from the
store into the ledger, logs each once, then claims the due ones and sends them. A gateway that
dies between the firing and the move leaves the alert in the store, where recovery moves it
with the dead gateway's admission entries (:func:`move_alerts`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING

import anyio
import httpx
from anyio.abc import TaskStatus

from .. import metrics
from ..clock import utcnow
from ..errors import ConfigurationError, LedgerUnavailable, StoreUnavailable
from ..limits.codec import field_of
from ..settings import AlertFormat, Settings
from ..store.rolling import Bucket
from .events import PROJECTED, Alert, alert_id, parse_bucket_pending, parse_pending, sample_alert
from .signing import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, sign

if TYPE_CHECKING:  # the ledger keeps alerts: it imports this package's values
    from ..engine.admin import UsageReport
    from ..ledger import Ledger
    from ..limits import KeyCodec
    from ..store import Store

    UsageOf = Callable[[str], Awaitable[UsageReport]]

log = logging.getLogger("spendguard.alerts")

_BATCH = 100  # alerts claimed per pass
_MAX_FORECAST_TEAMS = 1000  # teams forecast per pass; the rest wait for the next


async def keep_alerts(ledger: Ledger, fired: list[Alert]) -> list[Alert]:
    """Put ``fired`` into the outbox; log and count those new to it (each alert once, whoever
    adds it and however often)."""
    added = await ledger.add_alerts(fired)
    for alert in added:
        log.warning("%s", alert.text)
        metrics.ALERTS.labels(alert.kind).inc()
    return added


async def move_alerts(ledger: Ledger, store: Store, codec: KeyCodec, team: str) -> list[Alert]:
    """Move ``team``'s fired alerts from the store into the outbox; returns those new to it
    (each logged once, wherever it fired and whoever moves it). Raises if either side fails:
    nothing is forgotten before the ledger has it."""
    return await _move(
        ledger, store, codec.alerts_key(team), partial(parse_pending, team), f"team {team}"
    )


async def move_bucket_alerts(ledger: Ledger, store: Store, bucket: Bucket) -> list[Alert]:
    """:func:`move_alerts` for a budget bucket's fired alerts."""
    key = store.bucket_alerts_key(bucket)
    return await _move(ledger, store, key, partial(parse_bucket_pending, bucket), bucket.tag)


async def _move(
    ledger: Ledger,
    store: Store,
    key: str,
    parse: Callable[[str, str], Alert | None],
    whose: str,
) -> list[Alert]:
    pending = await store.pending_alerts(key)
    if not pending:
        return []
    fired: list[Alert] = []
    for name, value in pending.items():
        alert = parse(name, value)
        if alert is None:
            log.error("spendguard dropped an unreadable alert of %s: %r", whose, name)
        else:
            fired.append(alert)
    added = await keep_alerts(ledger, fired)
    await store.drop_alerts(key, list(pending))
    return added


async def sweep_bucket_alerts(ledger: Ledger, store: Store) -> int:
    """Move the fired alerts of every budget bucket the store has (after a gateway died with
    alerts it had not moved: which buckets they are in died with it). Returns how many."""
    moved = 0
    for bucket in await store.buckets():
        moved += len(await move_bucket_alerts(ledger, store, bucket))
    return moved


class AlertService:
    def __init__(
        self,
        ledger: Ledger,
        store: Store,
        codec: KeyCodec,
        *,
        webhook_url: str | None = None,
        secret: str | None = None,
        slack: bool = False,
        timeout: float = 5.0,
        max_backoff: float = 60.0,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], datetime] = utcnow,
        usage: UsageOf | None = None,
        forecast_interval: float = 60.0,
    ) -> None:
        self.ledger, self.store, self.codec = ledger, store, codec
        self.webhook_url = webhook_url
        self.secret = secret
        self.slack = slack
        self.timeout = timeout
        self.max_backoff = max_backoff
        self.clock = clock
        self._client = client
        self._teams: set[str] = set()
        # Projected alerts: the usage reports of the teams charged since the last forecast.
        self._usage = usage
        self.forecast_interval = forecast_interval
        self._charged: set[str] = set()
        self._buckets: set[tuple[Store, Bucket]] = set()
        self._next_forecast = clock()
        # Whether passes do anything: a gateway with no default thresholds starts idle (no
        # ledger query a second) and wakes at the first alert a limit of its own fires.
        self.active = True

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        ledger: Ledger,
        store: Store,
        codec: KeyCodec,
        *,
        clock: Callable[[], datetime] = utcnow,
        usage: UsageOf | None = None,
    ) -> AlertService:
        """The service the ``SPENDGUARD_ALERT_*`` settings describe (a gateway's, the CLI's)."""
        secret = settings.alert_webhook_secret
        return cls(
            ledger,
            store,
            codec,
            webhook_url=settings.alert_webhook_url,
            secret=secret.get_secret_value() if secret else None,
            slack=settings.alert_webhook_format is AlertFormat.SLACK,
            clock=clock,
            usage=usage,
            forecast_interval=settings.alert_forecast_interval,
        )

    def note(self, team: str) -> None:
        """``team``'s postflight fired an alert: move it on the next pass."""
        self._teams.add(team)
        self.active = True

    def note_bucket(self, store: Store, bucket: Bucket) -> None:
        """A budget commit on ``store`` fired an alert of ``bucket``: move it on the next
        pass (the store: the gateway's, or a budgets section's own in-process one)."""
        self._buckets.add((store, bucket))
        self.active = True

    def charged(self, team_id: str) -> None:
        """``team_id`` (as the host gave it) was charged: forecast it on the next forecast."""
        self._charged.add(team_id)

    async def run_once(self) -> tuple[int, int]:
        """One pass: move what was noted, deliver what is due. Returns (alerts moved into the
        outbox, alerts delivered); a store or ledger outage leaves the rest for the next."""
        if not self.active:
            return 0, 0
        moved = 0
        # Taken before moving: an alert noted while its team's move is under way (fired after
        # that move read the store) is moved by the next pass, not forgotten with this one.
        teams, self._teams = sorted(self._teams), set()
        for team in teams:
            try:
                moved += len(await move_alerts(self.ledger, self.store, self.codec, team))
            except (LedgerUnavailable, StoreUnavailable) as exc:
                log.warning("spendguard alerts of team %s wait for the next pass: %r", team, exc)
                self._teams.add(team)
        buckets, self._buckets = list(self._buckets), set()
        for store, bucket in buckets:
            try:
                moved += len(await move_bucket_alerts(self.ledger, store, bucket))
            except (LedgerUnavailable, StoreUnavailable) as exc:
                log.warning("spendguard alerts of %s wait for the next pass: %r", bucket.tag, exc)
                self._buckets.add((store, bucket))
        if self._usage is not None and self.clock() >= self._next_forecast:
            self._next_forecast = self.clock() + timedelta(seconds=self.forecast_interval)
            moved += len(await self.project())
        try:
            delivered = await self.deliver()
        except LedgerUnavailable as exc:
            log.warning("spendguard alert delivery waits for the ledger: %r", exc)
            delivered = 0
        return moved, delivered

    async def project(self) -> list[Alert]:
        """Fire a projected alert for every limit of a recently charged team that, at its
        recent spend rate, runs out before it resets (once per limit amount and window)."""
        assert self._usage is not None
        teams = sorted(self._charged)
        self._charged = set(teams[_MAX_FORECAST_TEAMS:])
        now = self.clock()
        fired: list[Alert] = []
        for team_id in teams[:_MAX_FORECAST_TEAMS]:
            try:
                report = await self._usage(team_id)
            except (LedgerUnavailable, StoreUnavailable) as exc:
                log.warning("spendguard forecast of team %s waits: %r", team_id, exc)
                self._charged.add(team_id)
                continue
            for row in report.limits:
                f, amount = row.forecast, row.amount
                if f is None or f.runs_out_at is None or amount is None or row.used >= amount:
                    continue  # not running out, or out already (the 100 % threshold's news)
                team = row.limit.team
                label = f"{field_of(row.limit)}:{row.bucket}"
                fired.append(
                    Alert(
                        alert_id(team, label, 100, amount, PROJECTED),
                        team,
                        row.limit.subject.api_key,
                        row.limit.window.value,
                        row.bucket,
                        100,
                        amount,
                        row.used,
                        now,
                        PROJECTED,
                        f.runs_out_at,
                    )
                )
        try:
            return await keep_alerts(self.ledger, fired) if fired else []
        except LedgerUnavailable as exc:
            log.warning("spendguard projected alerts wait for the ledger: %r", exc)
            self._charged.update(teams[:_MAX_FORECAST_TEAMS])
            return []

    async def deliver(self) -> int:
        """Send every alert due now; returns how many a receiver took (or, without a webhook,
        how many were logged as delivered)."""
        now = self.clock()
        claim_until = now + timedelta(seconds=self.timeout * 2 + 5)
        due = await self.ledger.claim_alerts(now, until=claim_until, limit=_BATCH)
        done = 0
        for alert in due:
            if self.webhook_url is None:
                await self.ledger.alert_delivered(alert.id, now)
                metrics.ALERT_DELIVERIES.labels("logged").inc()
                done += 1
                continue
            error = await self.send(alert)
            if error is None:
                await self.ledger.alert_delivered(alert.id, self.clock())
                metrics.ALERT_DELIVERIES.labels("delivered").inc()
                done += 1
                continue
            attempts = await self.ledger.alert_attempts(alert.id)
            delay = min(self.max_backoff, 2.0 ** max(0, attempts - 1))
            await self.ledger.alert_failed(alert.id, self.clock() + timedelta(seconds=delay), error)
            metrics.ALERT_DELIVERIES.labels("failed").inc()
            log.warning(
                "spendguard alert %s not delivered (attempt %d, next in %.0f s): %s",
                alert.id,
                attempts,
                delay,
                error,
            )
        return done

    async def send_sample(self) -> tuple[Alert, str | None]:
        """Send a ``spendguard.test`` alert to the webhook (``alerts test``): it, and None when
        a 2xx took it, else what went wrong. ConfigurationError without a webhook."""
        if self.webhook_url is None:
            raise ConfigurationError("no webhook: set SPENDGUARD_ALERT_WEBHOOK_URL")
        alert = sample_alert(self.clock())
        return alert, await self.send(alert)

    async def send(self, alert: Alert) -> str | None:
        """POST one alert to the webhook; None when a 2xx took it, else what went wrong."""
        assert self.webhook_url is not None
        body = alert.body(self.slack)
        headers = {"content-type": "application/json", IDEMPOTENCY_HEADER: alert.id}
        if self.secret:
            headers[SIGNATURE_HEADER] = sign(self.secret, body)
        client = self._client
        try:
            if client is None:
                async with httpx.AsyncClient(timeout=self.timeout) as own:
                    response = await own.post(self.webhook_url, content=body, headers=headers)
            else:
                response = await client.post(self.webhook_url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if 200 <= response.status_code < 300:
            return None
        return f"HTTP {response.status_code}"

    async def run(self, interval: float, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            try:
                await self.run_once()
            except Exception:  # a pass must never end the loop
                log.exception("spendguard alert pass failed")
            await anyio.sleep(interval)
