"""JSON views of what the admin API returns, shared by the CLI's ``--json`` output and the
admin HTTP routes so the two never drift: money as integer micro-USD next to an exact
decimal string."""

from __future__ import annotations

from typing import Any

from ..limits import Policy
from ..money import micros_to_usd


def usd_text(micros: int | None) -> str | None:
    """Micro-USD as an exact decimal string (``"1.500000"``); None stays None."""
    return None if micros is None else str(micros_to_usd(micros))


def policy_json(policy: Policy) -> dict[str, Any]:
    return {
        "team": policy.team_id,
        "api_key": policy.api_key_id,
        "period": policy.limit.window.value,
        "limit_micros": policy.amount,
        "limit_usd": usd_text(policy.amount),
        "mode": "hard" if policy.hard else "soft",
    }


def model_lists_json(team_id: str, lists: dict[str | None, list[str]]) -> dict[str, Any]:
    """A team's model lists, keyed by the encoded API key id ("" is the team's own list)."""
    return {"team": team_id, "lists": {key or "": pats for key, pats in lists.items()}}
