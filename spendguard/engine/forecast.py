"""Spend forecasts: at the rate a limit's usage grows, where it ends its window and when it
runs out.

The rate is the mean of two rates of the subject's charged spend: over the last hour (reacts
within minutes to a burst) and over the last 24 hours (steadies it against a quiet or a busy
hour). Spend is the postflight estimate of each charged record that started in the span (what
settlement charges, at the price the record carries). The projection assumes that rate holds
until the window resets: ``projected`` is the usage then, ``runs_out_at`` when usage reaches
the limit (None when it does not before the reset, or there is no limit; the current time
when it is reached already). A rough guide, not a promise: a new key has no history, and a
burst that just ended still weighs on the hour's rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from fractions import Fraction

HOUR_S = 3600
DAY_S = 86_400


@dataclass(frozen=True, slots=True)
class Forecast:
    last_hour: int  # micro-USD charged in the last hour
    last_day: int  # ... and in the last 24 hours
    rate_per_hour: int  # micro-USD per hour: the mean of the two rates, rounded up
    projected: int  # usage at the window's end at that rate
    runs_out_at: datetime | None  # when usage reaches the limit at that rate, before the reset


def forecast(
    used: int,
    limit: int | None,
    last_hour: int,
    last_day: int,
    now: datetime,
    resets_at: datetime,
) -> Forecast:
    """The forecast of a limit used ``used`` of ``limit`` (micro-USD) at ``now``."""
    per_s = (Fraction(last_hour, HOUR_S) + Fraction(last_day, DAY_S)) / 2
    left = Fraction(max(0, math.ceil((resets_at - now).total_seconds())))
    projected = used + math.ceil(per_s * left)
    runs_out: datetime | None = None
    if limit is not None:
        if used >= limit:
            runs_out = _whole(now)
        elif per_s > 0:
            seconds = Fraction(limit - used) / per_s
            if seconds < left:
                runs_out = _whole(now + timedelta(seconds=math.ceil(seconds)))
    return Forecast(last_hour, last_day, math.ceil(per_s * HOUR_S), projected, runs_out)


def _whole(at: datetime) -> datetime:
    """``at`` rounded up to a whole second (a projection has no finer grain to offer)."""
    return at if not at.microsecond else at.replace(microsecond=0) + timedelta(seconds=1)
