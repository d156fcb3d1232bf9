"""The routes the fake upstream answers, and which endpoint format each one speaks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

Kind = Literal["chat", "completions", "responses", "embeddings", "messages"]

ROUTES: Final[Mapping[str, Kind]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
}
"""Path → endpoint kind of every route the fake answers (all ``POST``)."""


def kind_for_path(path: str) -> Kind:
    """The endpoint kind of ``path``, which may carry a gateway prefix or a query string."""
    # Accept prefixes (/anthropic/v1/messages), query strings and a trailing slash, so a test can
    # pass the path its gateway exposes rather than the upstream one.
    bare = path.split("?", 1)[0].rstrip("/")
    for route, kind in ROUTES.items():
        if bare.endswith(route):
            return kind
    raise ValueError(f"not a fake-upstream route: {path!r} (known: {', '.join(ROUTES)})")
