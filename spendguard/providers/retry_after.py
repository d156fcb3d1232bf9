"""How long a provider asked us to wait: its ``Retry-After`` (seconds or an HTTP date) or
``retry-after-ms`` header, the input of :meth:`ProviderPool.cooldown` after a 429."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime


def retry_after_seconds(
    headers: Mapping[str, str], *, default: float, now: datetime | None = None
) -> float:
    """Seconds to wait from ``headers`` (keys lower-case, as httpx and Starlette give them),
    or ``default`` when the provider sent none or nothing readable.

    ``retry-after-ms`` (sent by some OpenAI-compatible services) wins over ``retry-after``
    because it is the finer of the two.
    """
    millis = _number(headers.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000
    raw = headers.get("retry-after")
    seconds = _number(raw)
    if seconds is not None:
        return seconds
    if raw:
        try:
            when = parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return default
        if when.tzinfo is None:  # an HTTP date is GMT by definition
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    return default


def _number(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
