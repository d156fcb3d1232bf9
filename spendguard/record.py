"""The inference record: the durable fact that one inference happened and what it used."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from .identity import Identity
from .usage import Usage


class PostflightStatus(StrEnum):
    APPLIED = "applied"  # the estimate is in the cache (as a per-record marker)
    SKIPPED = "skipped"  # no policy-bearing key existed: nothing to add
    UNKNOWN = "unknown"  # the store call failed or timed out: settlement corrects the cache


# Made on every request: not frozen, since a frozen dataclass's __init__ sets each field
# through object.__setattr__ (about 7x the cost). Hashed and compared by value like one;
# never assigned to after it is made.
@dataclass(slots=True, unsafe_hash=True)
class InferenceRecord:
    id: str  # unique per HTTP request
    inference_id: str  # shared by retries/fallbacks of one inference
    identity: Identity
    model: str
    route: str
    t0: datetime
    status_code: int
    usage: Usage
    estimate_micros: int  # what postflight added to the cache
    postflight: PostflightStatus
    # The unit prices the estimate was computed at (``Price.encode``), which settlement
    # charges whatever table the settling process has: '' = charged nothing (an unpriced
    # model), None = not known (an admission entry of an earlier release).
    price: str | None
    # Whom the app billed within its team, the request's tags, and the customer above its team
    # (raw, as given).
    end_user: str | None = None
    tags: tuple[str, ...] = ()
    customer: str | None = None
