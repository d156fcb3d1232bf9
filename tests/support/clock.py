"""A clock a test sets by hand: ``clock.now = ...`` moves time for everything that reads it."""

from __future__ import annotations

from datetime import UTC, datetime

# Noon on the last day of a month: a day and a month end within reach of one test.
DEFAULT_NOW = datetime(2026, 9, 30, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime | None = None) -> None:
        self.now = now or DEFAULT_NOW

    def __call__(self) -> datetime:
        return self.now
