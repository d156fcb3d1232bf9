"""Webhook signatures: HMAC-SHA256 over the timestamp and the body, so a receiver can check
that the alert came from this gateway and is fresh.

The header reads ``t=<unix seconds>,v1=<hex digest>``; the digest is
``HMAC_SHA256(secret, "<t>.<body>")`` over the exact bytes sent. A receiver recomputes it and
refuses a timestamp older than its tolerance (a replay).
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "spendguard-signature"
IDEMPOTENCY_HEADER = "idempotency-key"


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The signature header's value for ``body``."""
    t = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance: float = 300, now: float | None = None
) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` within ``tolerance`` seconds."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    t, given = parts.get("t", ""), parts.get("v1", "")
    if not t.isdigit() or not given:
        return False
    current = time.time() if now is None else now
    if abs(current - int(t)) > tolerance:
        return False
    expected = sign(secret, body, int(t)).partition(",v1=")[2]
    return hmac.compare_digest(expected, given)
