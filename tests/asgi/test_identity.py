"""Tests for spendguard.asgi.identity: the identity of a request comes from the host app's auth
(the request state, an authenticated user, or a resolver), never from headers."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import HTTPConnection

from spendguard.asgi import identity as identity_module
from spendguard.asgi.identity import from_auth_state, resolve
from spendguard.identity import Identity
from tests.support import http_scope

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")


def conn(
    state: dict[str, Any] | None = None, user: object = None, **headers: str
) -> HTTPConnection:
    scope = http_scope(
        "POST", "/v1/chat/completions", [(k.encode(), v.encode()) for k, v in headers.items()]
    )
    if state is not None:
        scope["state"] = state
    if user is not None:
        scope["user"] = user
    return HTTPConnection(scope)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"spendguard_identity": ALPHA}, ALPHA),
        ({"spendguard_identity": ("acme", "alpha")}, ALPHA),
        ({"spendguard_identity": ("acme", None)}, Identity("acme")),
        ({"team_id": "acme", "api_key_id": "alpha"}, ALPHA),
        ({"team_id": "acme"}, Identity("acme")),
        # The explicit identity wins over the separate ids.
        ({"spendguard_identity": ALPHA, "team_id": "other"}, ALPHA),
    ],
)
def test_identity_from_the_request_state(state: dict[str, Any], expected: Identity) -> None:
    assert from_auth_state(conn(state)) == expected


def test_identity_from_an_authenticated_user() -> None:
    user = SimpleNamespace(team_id="acme", api_key_id="alpha")
    assert from_auth_state(conn(user=user)) == ALPHA
    assert from_auth_state(conn(user=SimpleNamespace(team_id="acme"))) == Identity("acme")
    # The state comes first.
    assert from_auth_state(conn({"team_id": "other"}, user=user)) == Identity("other")
    assert from_auth_state(conn(user=SimpleNamespace(name="anonymous"))) is None


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"team_id": ""},
        {"team_id": 42},
        {"team_id": "acme", "api_key_id": ""},
        {"team_id": "acme", "api_key_id": 7},
        {"spendguard_identity": "acme"},
        {"spendguard_identity": ("acme", "alpha", "extra")},
        {"spendguard_identity": ("", "alpha")},
    ],
)
def test_anything_else_is_no_identity(state: dict[str, Any]) -> None:
    assert from_auth_state(conn(state)) is None


def test_headers_are_never_identity() -> None:
    request = conn(None, **{"x-team-id": "acme", "x-api-key-id": "alpha", "team_id": "acme"})
    assert from_auth_state(request) is None


async def test_no_resolver_reads_the_auth_state() -> None:
    assert await resolve(None, conn({"team_id": "acme", "api_key_id": "alpha"})) == ALPHA
    assert await resolve(None, conn({})) is None


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (ALPHA, ALPHA),
        (("acme", "alpha"), ALPHA),
        (("acme", None), Identity("acme")),
        (None, None),
        ("acme", None),
        (("acme", 5), None),
    ],
)
async def test_sync_and_async_resolvers_give_the_same_identity(
    returned: object, expected: Identity | None
) -> None:
    def sync(c: HTTPConnection) -> Any:
        return returned

    async def async_(c: HTTPConnection) -> Any:
        return returned

    # A resolver decides alone: the auth state is not consulted once one is set.
    request = conn({"team_id": "other"})
    assert await resolve(sync, request) == expected
    assert await resolve(async_, request) == expected


async def test_the_resolver_gets_the_request() -> None:
    def by_header(c: HTTPConnection) -> tuple[str, str]:
        return (c.headers["x-tenant"], "k")

    assert await resolve(by_header, conn(**{"x-tenant": "acme"})) == Identity("acme", "k")


async def test_a_resolver_that_raises_is_no_identity_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(c: HTTPConnection) -> Identity:
        raise KeyError("authorization")

    async def broken_async(c: HTTPConnection) -> Identity:
        raise RuntimeError("auth service down")

    caplog.set_level(logging.WARNING, "spendguard")
    assert await resolve(broken, conn()) is None
    assert await resolve(broken_async, conn()) is None
    failures = [r for r in caplog.records if "identity resolver failed" in r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info for r in failures)


async def test_a_pair_seen_again_gives_the_identity_made_the_first_time() -> None:
    # An Identity is made (ids validated and encoded) once per (team, key) pair: a gateway
    # sees the same pairs on every request.
    first = await resolve(lambda c: ("acme", "alpha"), conn())
    again = await resolve(None, conn({"team_id": "acme", "api_key_id": "alpha"}))
    assert first == ALPHA and again is first
    assert await resolve(lambda c: ("acme", None), conn()) is not first


async def test_identities_made_are_bounded_and_str_subclasses_are_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(identity_module, "_MADE", {})
    monkeypatch.setattr(identity_module, "_MAX_MADE", 3)
    for i in range(10):
        assert await resolve(lambda c, i=i: (f"team-{i}", None), conn()) == Identity(f"team-{i}")
        assert len(identity_module._MADE) <= 3

    class Tenant(str):
        pass

    found = await resolve(lambda c: (Tenant("acme"), "alpha"), conn())
    assert found == ALPHA
    assert all(type(team) is str for team, _ in identity_module._MADE)
    # A pair of plain strings is cached; an equal pair of a subclass still gets its own.
    plain = await resolve(lambda c: ("acme", "alpha"), conn())
    assert await resolve(lambda c: ("acme", "alpha"), conn()) is plain
    other = await resolve(lambda c: (Tenant("acme"), "alpha"), conn())
    assert other is not plain and type(other.team_id) is Tenant
