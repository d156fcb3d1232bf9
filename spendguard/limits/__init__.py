"""Limits as typed values, and the one codec that turns them into cache keys and back."""

from __future__ import annotations

from .codec import Check, KeyCodec, KeyPlan, window_of
from .model import (
    Balance,
    Limit,
    Policy,
    Subject,
    SubjectKind,
    Target,
    Unit,
    applicable,
    key_limit,
    limit_for,
    team_limit,
)
from .windows import Period, Window

__all__ = [
    "Balance",
    "Check",
    "KeyCodec",
    "KeyPlan",
    "Limit",
    "Period",
    "Policy",
    "Subject",
    "SubjectKind",
    "Target",
    "Unit",
    "Window",
    "applicable",
    "key_limit",
    "limit_for",
    "team_limit",
    "window_of",
]
