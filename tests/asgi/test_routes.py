"""Tests for spendguard.asgi.routes: which requests are inferences, and in which dialect."""

from __future__ import annotations

from typing import Any

import pytest

from spendguard.asgi.routes import AMBIGUOUS, RouteTable, canonical_path, dialect_of
from spendguard.errors import ConfigurationError
from spendguard.settings import DEFAULT_ROUTES, load_settings
from spendguard.usage import Dialect
from tests.support import http_scope


def scope(path: str, method: str = "POST", root_path: str = "") -> dict[str, Any]:
    return {**http_scope(method, path), "root_path": root_path}


class _Table:
    """A table whose matches compare as (route, dialect) pairs, the model checked apart."""

    def __init__(self, table: RouteTable) -> None:
        self.table = table

    def match(self, scope: dict[str, Any]) -> tuple[str, Dialect] | None:
        found = self.table.match(scope)
        return None if found is None else (found.route, found.dialect)


TABLE = _Table(RouteTable(DEFAULT_ROUTES))


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
    custom = _Table(RouteTable(["/custom/infer/"]))
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
    # No root path: no stripping (the route recorded is the path as sent).
    assert TABLE.match(scope("/gw/v1/responses")) == ("/gw/v1/responses", Dialect.OPENAI)
    assert TABLE.match(scope("/gw/v1/completions")) is None


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS", "HEAD", "post"])
def test_only_post_is_an_inference(method: str) -> None:
    assert TABLE.match(scope("/v1/chat/completions", method=method)) is None


def test_the_anthropic_dialect_goes_with_a_messages_path() -> None:
    table = _Table(RouteTable(["/custom/messages", "/custom/messages/batch", "/messages"]))
    assert table.match(scope("/custom/messages")) == ("/custom/messages", Dialect.ANTHROPIC)
    assert table.match(scope("/messages")) == ("/messages", Dialect.ANTHROPIC)
    # Only the last segment counts: "messages" earlier in the path is not Anthropic's route.
    assert table.match(scope("/custom/messages/batch")) == (
        "/custom/messages/batch",
        Dialect.OPENAI,
    )


def test_path_parameter_patterns_match_and_answer_with_the_real_path() -> None:
    table = _Table(
        RouteTable(
            [
                "/v1/chat/completions",
                "/openai/deployments/{deployment}/chat/completions",
                "/claude/{version:int}/messages",
            ]
        )
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
    table = _Table(RouteTable(["/llm/{rest:path}"]))
    assert table.match(scope("/llm/v1/chat/completions")) == (
        "/llm/v1/chat/completions",
        Dialect.OPENAI,
    )
    assert table.match(scope("/llm/v1/messages")) == ("/llm/v1/messages", Dialect.ANTHROPIC)
    assert table.match(scope("/other/v1/chat/completions")) is None


def test_a_route_written_with_the_mount_prefix_matches_inside_the_mount_too() -> None:
    table = _Table(
        RouteTable(["/llm/v1/chat/completions", "/llm/deployments/{d}/chat/completions"])
    )
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
        _Table(RouteTable([path]))
    with pytest.raises(ConfigurationError, match="SPENDGUARD_ROUTES"):
        load_settings(routes=path)


# -- canonical matching: the path the app and its upstream act on ----------------------------


@pytest.mark.parametrize(
    "spelling",
    [
        "//v1/chat/completions",
        "/v1//chat/completions",
        "/v1/chat//completions",
        "/v1/./chat/completions",
        "/v1/chat/../chat/completions",
        "/v1/chat/completions/.",
        "/../v1/chat/completions",  # ".." never climbs above the root (RFC 3986)
        "/v1/chat%2Fcompletions",  # an encoded slash is a slash
        "/v1/chat%252Fcompletions",  # encoded twice: an upstream client decodes it again
        "/v1/%63hat/completions",  # an encoded unreserved letter
        "/v1\\chat\\completions",
        "/V1/Chat/Completions",
        "/v1/chat/completions%2F",
    ],
)
def test_every_spelling_of_a_guarded_route_is_that_route(spelling: str) -> None:
    assert TABLE.match(scope(spelling)) == ("/v1/chat/completions", Dialect.OPENAI)


@pytest.mark.parametrize("path", ["/v1/chat/completions\x00", "/v1/\x1bchat/completions"])
def test_a_path_with_control_characters_is_ambiguous(path: str) -> None:
    assert RouteTable(DEFAULT_ROUTES).match(scope(path)) is AMBIGUOUS


def test_a_path_encoded_more_often_than_anyone_decodes_is_ambiguous() -> None:
    assert canonical_path("/v1/chat%25252525252Fcompletions") is None
    # Invalid UTF-8 once decoded: no two readers agree on what it spells.
    assert canonical_path("/v1/chat%FF/completions") is None
    # A percent sign that is no escape is kept.
    assert canonical_path("/v1/100%/x") == "/v1/100%/x"


def test_a_mounted_path_spelled_oddly_matches_relative_to_the_mount() -> None:
    assert TABLE.match(scope("/gw//v1/chat/completions", root_path="/gw")) == (
        "/v1/chat/completions",
        Dialect.OPENAI,
    )


@pytest.mark.parametrize(
    "path",
    [
        f"{prefix}{endpoint}"
        for prefix in ("", "/v1", "/openai", "/openai/v1")
        for endpoint in (
            "/chat/completions",
            "/completions",
            "/responses",
            "/responses/compact",
            "/embeddings",
            "/messages",
        )
    ]
    + ["/anthropic/v1/messages", "/queue/chat/completions", "/cursor/chat/completions"]
    + ["/claude_code_gateway/v1/messages", "/gw/v1/responses", "/gw/v1/embeddings"],
)
def test_the_defaults_cover_the_compatible_surface(path: str) -> None:
    found = TABLE.match(scope(path))
    assert found is not None and found[1] is dialect_of(path)


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/openai/deployments/gpt-4o-mini/chat/completions", "gpt-4o-mini"),
        ("/openai/deployments/azure/gpt-4o/completions", "azure/gpt-4o"),
        ("/openai/deployments/text-embedding-3-small/embeddings", "text-embedding-3-small"),
        ("/engines/gpt-4o-mini/chat/completions", "gpt-4o-mini"),
        ("/v1/engines/davinci-002/completions", "davinci-002"),
        ("/openai/deployments//gpt-4o//chat/completions", "gpt-4o"),
    ],
)
def test_the_model_of_a_deployment_route_comes_from_its_path(path: str, model: str) -> None:
    found = RouteTable(DEFAULT_ROUTES).match(scope(path))
    assert found is not None and found.model == model


@pytest.mark.parametrize(
    "path",
    ["/v1/threads/abc/messages", "/key/generate", "/v1/chat/completions/abc/messages/x", "/"],
)
def test_routes_that_are_no_inference_stay_unmatched(path: str) -> None:
    assert TABLE.match(scope(path)) is None
