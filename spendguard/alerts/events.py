"""An alert: what crossed which threshold of whose limit, as the outbox keeps it and as a
webhook receives it."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..clock import from_micros, time_text
from ..limits import Limit, Period
from ..limits.codec import parse_field
from ..limits.model import SubjectKind
from ..money import usd_text
from ..store.rolling import Bucket

THRESHOLD = "threshold"  # a percentage of a limit reached
PROJECTED = "projected"  # at the recent spend rate, the limit runs out before it resets
TEST = "test"  # `spendguard alerts test`: a sample, never stored
BALANCE = "balance"  # an alert's window when it is of a prepaid balance (and its store label)
SPEND, BUDGET = "spend", "budget"  # an alert's scope: a spend limit or balance; a budget
USD, TOKENS = "usd", "tokens"
_UNITS = {"t": TOKENS, "c": USD}  # a budget store's unit letters


@dataclass(frozen=True, slots=True)
class Alert:
    """One threshold of one limit in one window (``bucket``), reached once."""

    id: str  # the same wherever and however often it fires: the receiver's idempotency key
    team: str  # encoded ids, as the ledger keeps them
    api_key: str | None
    window: str  # "day" or "month", or "balance" (a prepaid balance: no window)
    bucket: str  # the window's id: 20261203, 202612 ("" for a balance)
    percent: int
    limit_micros: int
    used_micros: int  # when it fired
    fired_at: datetime
    kind: str = THRESHOLD
    runs_out_at: datetime | None = None  # a projected alert's forecast
    # What kind of limit: a spend limit or balance (SPEND), or a rolling budget (BUDGET: then
    # ``window`` is the budget window's id, ``bucket`` the epoch of its length it fired in,
    # ``team`` "" for a model's or the fleet's budget, ``model`` the model's).
    scope: str = SPEND
    unit: str = USD  # or TOKENS: limit_micros and used_micros then count tokens
    model: str | None = None

    @property
    def resets_at(self) -> datetime | None:
        """When the limit's window ends (None: a balance, which ends when it is topped up)."""
        if self.window == BALANCE or self.scope == BUDGET:
            return None  # a rolling window drains instead
        start = datetime.strptime(self.bucket + ("01" if len(self.bucket) == 6 else ""), "%Y%m%d")
        return Period(self.window).end(start.replace(tzinfo=UTC))

    @property
    def who(self) -> str:
        if self.scope == BUDGET and not self.team:
            return "the fleet" if self.model is None else f"model {self.model}"
        return self.team if self.api_key is None else f"{self.team}/{self.api_key}"

    def _amount(self, value: int) -> str:
        return f"{value:,} tokens" if self.unit == TOKENS else f"${usd_text(value)}"

    @property
    def text(self) -> str:
        """One line a person reads (the log line, Slack's text)."""
        if self.scope == BUDGET:
            return (
                f"spendguard: {self.who} reached {self.percent}% of its {self.window} budget of "
                f"{self._amount(self.limit_micros)} ({self._amount(self.used_micros)} used in "
                "the window)"
            )
        if self.window == BALANCE:
            return (
                f"spendguard: {self.who} used {self.percent}% of its prepaid balance of "
                f"${usd_text(self.limit_micros)} (${usd_text(self.used_micros)} used, "
                f"${usd_text(max(0, self.limit_micros - self.used_micros))} left)"
            )
        resets = "never" if self.resets_at is None else time_text(self.resets_at)
        if self.kind == PROJECTED and self.runs_out_at is not None:
            return (
                f"spendguard: {self.who} is projected to run out of its {self.window} limit of "
                f"${usd_text(self.limit_micros)} at {time_text(self.runs_out_at)}, before it "
                f"resets {resets} (${usd_text(self.used_micros)} used)"
            )
        return (
            f"spendguard: {self.who} reached {self.percent}% of its {self.window} limit of "
            f"${usd_text(self.limit_micros)} (${usd_text(self.used_micros)} used, "
            f"resets {resets})"
        )

    def as_json(self) -> dict[str, Any]:
        usd = self.unit == USD
        return {
            "id": self.id,
            "type": f"spendguard.{self.kind}",
            "team": self.team,
            "api_key": self.api_key,
            "window": self.window,
            "window_id": self.bucket,
            "threshold_percent": self.percent,
            "scope": self.scope,
            "model": self.model,
            "unit": self.unit,
            "limit_usd": usd_text(self.limit_micros) if usd else None,
            "used_usd": usd_text(self.used_micros) if usd else None,
            "limit_micros": self.limit_micros if usd else None,
            "used_micros": self.used_micros if usd else None,
            "limit_tokens": None if usd else self.limit_micros,
            "used_tokens": None if usd else self.used_micros,
            "fired_at": time_text(self.fired_at),
            "resets_at": None if self.resets_at is None else time_text(self.resets_at),
            "runs_out_at": None if self.runs_out_at is None else time_text(self.runs_out_at),
        }

    def body(self, slack: bool = False) -> bytes:
        """The webhook's body: the alert's JSON, or a Slack-compatible message carrying it."""
        data = self.as_json()
        if slack:
            data = {"text": self.text, "spendguard": data}
        return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def alert_id(team: str, label: str, percent: int, limit: int, kind: str = THRESHOLD) -> str:
    """The same for every firing of one threshold of one limit amount in one window."""
    raw = f"{team}\0{label}\0{percent}\0{limit}".encode()
    if kind != THRESHOLD:
        raw += f"\0{kind}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def parse_pending(team: str, field: str, value: str) -> Alert | None:
    """The alert a store's pending hash holds (see :class:`~spendguard.store.AlertMarks`);
    None for anything else (never raises)."""
    try:
        label, pct, limit = field.split(" ")
        used, ms = value.split(" ")
        if label == BALANCE:
            api_key, window, bucket = None, BALANCE, ""
        else:
            stem, _, bucket = label.rpartition(":")
            target = parse_field(team, stem)
            if not isinstance(target, Limit) or not bucket.isdigit():
                return None
            api_key, window = target.subject.api_key, target.window.value
        return Alert(
            alert_id(team, label, int(pct), int(limit)),
            team,
            api_key,
            window,
            bucket,
            int(pct),
            int(limit),
            int(used),
            from_micros(int(ms) * 1000),
        )
    except ValueError:
        return None


def parse_bucket_pending(bucket: Bucket, field: str, value: str) -> Alert | None:
    """The alert a budget bucket's pending hash holds (see ``Store.commit_buckets``); None
    for anything else (never raises)."""
    try:
        window, unit, pct, limit, epoch = field.split(" ")
        used, ms = value.split(" ")
        if unit not in _UNITS or not epoch.isdigit():
            return None
        team, api_key, model = "", None, None
        if bucket.kind is SubjectKind.API_KEY:
            team, _, api_key = bucket.subject.partition(":")
        elif bucket.kind is SubjectKind.END_USER:
            team = bucket.subject.partition(":")[0]
        elif bucket.kind is SubjectKind.MODEL:
            model = bucket.subject
        label = f"{BUDGET} {bucket.tag} {window} {unit} {epoch}"
        return Alert(
            alert_id(team, label, int(pct), int(limit)),
            team,
            api_key,
            window,
            epoch,
            int(pct),
            int(limit),
            int(used),
            from_micros(int(ms) * 1000),
            scope=BUDGET,
            unit=_UNITS[unit],
            model=model,
        )
    except ValueError:
        return None


def sample_alert(now: datetime) -> Alert:
    """What ``spendguard alerts test`` sends: a threshold alert of made-up ids, typed
    ``spendguard.test`` so a receiver can tell it from a real one."""
    return Alert(
        f"test-{secrets.token_hex(12)}",
        "example-team",
        "example-key",
        Period.DAY.value,
        Period.DAY.bucket(now),
        80,
        10_000_000,
        8_000_000,
        now,
        TEST,
    )
