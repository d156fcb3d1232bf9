"""Tests for spendguard.asgi.routes: which requests are inferences, and in which dialect."""

from __future__ import annotations

from typing import Any

import pytest

from spendguard.asgi.routes import RouteTable
from spendguard.errors import ConfigurationError
from spendguard.settings import DEFAULT_ROUTES, load_settings
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


def test_path_parameter_patterns_match_and_answer_with_the_real_path() -> None:
    table = RouteTable(
        [
            "/v1/chat/completions",
            "/openai/deployments/{deployment}/chat/completions",
            "/claude/{version:int}/messages",
        ]
    )
    azure = "/openai/deployments/gpt-4o-prod/chat/completions"
    assert table.match(scope(azure)) == (azure, Dialect.OPENAI)
    assert table.match(scope(azure + "/")) == (azure, Dialect.OPENAI)
    assert table.match(scope("/claude/3/messages")) == ("/claude/3/messages", Dialect.ANTHROPIC)
    assert table.match(scope("/claude/three/messages")) is None  # the convertor holds
    assert table.match(scope("/openai/deployments/a/b/chat/completions")) is None  # one segment
    assert table.match(scope("/openai/deployments/x/chat/completions", method="GET")) is None
    assert table.match(scope("/v1/chat/completions")) == ("/v1/chat/completions", Dialect.OPENAI)


def test_a_path_pattern_covers_everything_under_a_prefix() -> None:
    table = RouteTable(["/llm/{rest:path}"])
    assert table.match(scope("/llm/v1/chat/completions")) == (
        "/llm/v1/chat/completions",
        Dialect.OPENAI,
    )
    assert table.match(scope("/llm/v1/messages")) == ("/llm/v1/messages", Dialect.ANTHROPIC)
    assert table.match(scope("/other/v1/chat/completions")) is None


def test_a_route_written_with_the_mount_prefix_matches_inside_the_mount_too() -> None:
    table = RouteTable(["/llm/v1/chat/completions", "/llm/deployments/{d}/chat/completions"])
    # The middleware on the top app: the full path.
    assert table.match(scope("/llm/v1/chat/completions")) is not None
    # The middleware on the app mounted at /llm: Starlette passes the prefix as root_path.
    inside = scope("/llm/v1/chat/completions", root_path="/llm")
    assert table.match(inside) == ("/llm/v1/chat/completions", Dialect.OPENAI)
    inside = scope("/llm/deployments/x/chat/completions", root_path="/llm")
    assert table.match(inside) == ("/llm/deployments/x/chat/completions", Dialect.OPENAI)


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/x/{d:nope}/chat", "unknown path convertor 'nope'"),
        ("/x/{d/chat", "unbalanced braces"),
        ("/x/{d-1}/chat", "not a path parameter"),
        ("/x/d}/chat", "unbalanced braces"),
        ("/x/{}/chat", "not a path parameter"),
    ],
)
def test_a_bad_pattern_is_refused_naming_the_problem(path: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RouteTable([path])
    with pytest.raises(ConfigurationError, match="SPENDGUARD_ROUTES"):
        load_settings(routes=path)
