"""Spellings of ``/v1/chat/completions`` a client can send, each read as that path by a
router, a forwarding proxy or its upstream HTTP client (send them byte for byte)."""

from __future__ import annotations

CHAT_SPELLINGS = (
    "//v1/chat/completions",
    "/v1//chat/completions",
    "/v1/chat//completions",
    "/v1/./chat/completions",
    "/v1/chat/../chat/completions",
    "/v1/chat/completions/",
    "/v1/chat%2Fcompletions",
    "/v1/%63hat/completions",
)
