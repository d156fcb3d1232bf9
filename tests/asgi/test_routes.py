"""Tests for spendguard.asgi.routes: which requests are inferences, and in which dialect."""

from __future__ import annotations

from typing import Any

import pytest

from spendguard.asgi.routes import RouteTable
from spendguard.settings import DEFAULT_ROUTES
from spendguard.usage import Dialect
from tests.support import http_scope

TABLE = RouteTable(DEFAULT_ROUTES)


def scope(path: str, method: str = "POST", root_path: str = "") -> dict[str, Any]:
    return {**http_scope(method, path), "root_path": root_path}


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        ("/v1/chat/completions", Dialect.OPENAI),
        ("/v1/completions", Dialect.OPENAI),
        ("/v1/responses", Dialect.OPENAI),
        ("/v1/embeddings", Dialect.OPENAI),
        ("/v1/messages", Dialect.ANTHROPIC),
        ("/anthropic/v1/messages", Dialect.ANTHROPIC),
    ],
)
def test_each_default_route_matches_exactly_in_its_dialect(path: str, dialect: Dialect) -> None:
    assert TABLE.match(scope(path)) == (path, dialect)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat",  # a prefix of a route
        "/v1/chat/completions/extra",  # a route as a prefix
        "/V1/chat/completions",  # paths are case-sensitive
        "/health",
        "/",
        "",
        "/v1/chat/completions//x",
    ],
)
def test_other_paths_are_not_inferences(path: str) -> None:
    assert TABLE.match(scope(path)) is None


def test_a_trailing_slash_matches_the_route_without_it() -> None:
    assert TABLE.match(scope("/v1/chat/completions/")) == ("/v1/chat/completions", Dialect.OPENAI)
    assert TABLE.match(scope("/v1/messages///")) == ("/v1/messages", Dialect.ANTHROPIC)
    # A route configured with a trailing slash is stored without it.
    custom = RouteTable(["/custom/infer/"])
    assert custom.match(scope("/custom/infer")) == ("/custom/infer", Dialect.OPENAI)
    assert custom.match(scope("/custom/infer/")) == ("/custom/infer", Dialect.OPENAI)


def test_paths_are_matched_relative_to_the_root_path() -> None:
    mounted = scope("/gw/v1/chat/completions", root_path="/gw")
    assert TABLE.match(mounted) == ("/v1/chat/completions", Dialect.OPENAI)
    mounted_anthropic = scope("/api/anthropic/v1/messages", root_path="/api")
    assert TABLE.match(mounted_anthropic) == ("/anthropic/v1/messages", Dialect.ANTHROPIC)
    # A root path the path does not start with is left alone.
    assert TABLE.match(scope("/v1/responses", root_path="/gw")) == (
        "/v1/responses",
        Dialect.OPENAI,
    )
    assert TABLE.match(scope("/gw/v1/responses")) is None  # no root path: no stripping


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS", "HEAD", "post"])
def test_only_post_is_an_inference(method: str) -> None:
    assert TABLE.match(scope("/v1/chat/completions", method=method)) is None


def test_the_anthropic_dialect_goes_with_a_messages_path() -> None:
    table = RouteTable(["/custom/messages", "/custom/messages/batch", "/messages"])
    assert table.match(scope("/custom/messages")) == ("/custom/messages", Dialect.ANTHROPIC)
    assert table.match(scope("/messages")) == ("/messages", Dialect.ANTHROPIC)
    # Only the last segment counts: "messages" earlier in the path is not Anthropic's route.
    assert table.match(scope("/custom/messages/batch")) == (
        "/custom/messages/batch",
        Dialect.OPENAI,
    )
