"""Tests for spendguard.asgi.keys: the API key in the headers the SDKs send, its hash as LiteLLM
stores it, and a resolver that maps keys to identities (checked through the middleware too)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from starlette.requests import HTTPConnection

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi.identity import IdentityLike, resolve
from spendguard.asgi.keys import KEY_HEADERS, api_key_from_headers, from_api_key, hashed_key
from spendguard.identity import Identity
from spendguard.store.memory import MemoryStore
from tests.support import chat_body, client, http_scope, upstream, write_unit_prices

pytestmark = pytest.mark.anyio

KEY = "sk-live-0123456789"


def scope(*headers: tuple[str, str]) -> dict[str, object]:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    return http_scope("POST", "/v1/chat/completions", raw)


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", f"Bearer {KEY}")],  # OpenAI and most SDKs
        [("authorization", f"bearer {KEY}")],  # any case of the scheme
        [("Authorization", f"BEARER   {KEY}  ")],  # and its spacing
        [("x-api-key", KEY)],  # Anthropic
        [("api-key", KEY)],  # Azure OpenAI
        [("X-Api-Key", f" {KEY} ")],
        # The same key in several headers (an SDK that sends both) is that key.
        [("authorization", f"Bearer {KEY}"), ("x-api-key", KEY)],
        [("x-api-key", KEY), ("x-api-key", KEY)],
        # Empty values and another scheme carry no key; the other header still does.
        [("authorization", "Basic dXNlcjpwYXNz"), ("x-api-key", KEY)],
        [("authorization", "Bearer "), ("api-key", KEY)],
        [("x-api-key", ""), ("authorization", f"Bearer {KEY}")],
    ],
)
def test_the_key_comes_from_the_header_its_sdk_sends(headers: list[tuple[str, str]]) -> None:
    assert api_key_from_headers(scope(*headers)) == KEY
    assert api_key_from_headers(HTTPConnection(scope(*headers))) == KEY


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("authorization", "Basic dXNlcjpwYXNz")],
        [("authorization", KEY)],  # no scheme: not a bearer token
        [("authorization", "Bearer")],
        [("x-api-key", "   ")],
        [("cookie", f"key={KEY}"), ("x-goog-api-key", KEY)],  # not read unless asked for
        # Two different keys: the gateway's auth may believe either, so neither is charged.
        [("authorization", f"Bearer {KEY}"), ("x-api-key", "sk-other")],
        [("api-key", KEY), ("authorization", "Bearer sk-other")],
        [("x-api-key", KEY), ("x-api-key", "sk-other")],
    ],
)
def test_no_key_or_an_ambiguous_one_is_none(headers: list[tuple[str, str]]) -> None:
    assert api_key_from_headers(scope(*headers)) is None


def test_the_headers_read_can_be_chosen() -> None:
    google = scope(("x-goog-api-key", KEY))
    assert api_key_from_headers(google) is None
    assert api_key_from_headers(google, headers=(*KEY_HEADERS, "X-Goog-Api-Key")) == KEY
    # Only the headers named: an Anthropic key is ignored by an OpenAI-only resolver.
    assert api_key_from_headers(scope(("x-api-key", KEY)), headers=["authorization"]) is None
    both = scope(("authorization", f"Bearer {KEY}"), ("x-litellm-api-key", f"Bearer {KEY}"))
    assert api_key_from_headers(both, headers=("authorization", "x-litellm-api-key")) == KEY


def test_a_key_is_text_even_when_its_bytes_are_not_ascii() -> None:
    raw = http_scope("POST", "/v1/chat/completions", [(b"x-api-key", b"sk-\xe9\xff")])
    assert api_key_from_headers(raw) == "sk-\xe9\xff"  # latin-1, as HTTP headers decode


def test_hashed_key_is_the_hex_sha256_litellm_stores() -> None:
    # The digest LiteLLM's hash_token computes: hashlib.sha256(token.encode()).hexdigest().
    assert hashed_key("sk-1234") == hashlib.sha256(b"sk-1234").hexdigest()
    assert hashed_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hashed_key("sk-ü") == hashlib.sha256("sk-ü".encode()).hexdigest()
    assert hashed_key("a") != hashed_key("b")


TEAMS: dict[str, IdentityLike] = {
    hashed_key(KEY): ("acme", "alpha"),
    hashed_key("sk-team-only"): ("acme", None),
}


async def test_a_sync_lookup_maps_the_key_to_its_identity() -> None:
    seen: list[str] = []

    def lookup(key: str) -> IdentityLike:
        seen.append(key)
        return TEAMS.get(hashed_key(key))

    resolver = from_api_key(lookup)
    ok = HTTPConnection(scope(("authorization", f"Bearer {KEY}")))
    assert await resolve(resolver, ok) == Identity("acme", "alpha")
    team = HTTPConnection(scope(("x-api-key", "sk-team-only")))
    assert await resolve(resolver, team) == Identity("acme")
    assert await resolve(resolver, HTTPConnection(scope(("api-key", "sk-unknown")))) is None
    assert seen == [KEY, "sk-team-only", "sk-unknown"]
    # No key (or an ambiguous one): the lookup is not asked at all.
    assert await resolve(resolver, HTTPConnection(scope())) is None
    two = scope(("authorization", f"Bearer {KEY}"), ("x-api-key", "sk-team-only"))
    assert await resolve(resolver, HTTPConnection(two)) is None
    assert len(seen) == 3


async def test_an_async_lookup_is_awaited() -> None:
    async def lookup(key: str) -> IdentityLike:
        return Identity("acme", "alpha") if key == KEY else None

    resolver = from_api_key(lookup)
    assert "lookup" in resolver.__name__
    assert await resolve(resolver, HTTPConnection(scope(("x-api-key", KEY)))) == Identity(
        "acme", "alpha"
    )
    assert await resolve(resolver, HTTPConnection(scope(("x-api-key", "sk-no")))) is None


async def test_a_lookup_that_raises_is_no_identity() -> None:
    def lookup(key: str) -> IdentityLike:
        raise KeyError(key)

    conn = HTTPConnection(scope(("authorization", f"Bearer {KEY}")))
    assert await resolve(from_api_key(lookup), conn) is None


async def test_the_middleware_limits_the_key_the_client_sent(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}", prices=write_unit_prices(tmp_path)
    )
    guard = SpendGuard(settings, store=MemoryStore())
    resolver = from_api_key(lambda key: TEAMS.get(hashed_key(key)))
    app = SpendGuardMiddleware(upstream(), guard=guard, resolve_identity=resolver)
    await guard.start(worker=False)
    try:
        await guard.admin.set_policy("acme", "alpha", window="day", limit_usd=0)

        async def post(headers: Sequence[tuple[str, str]]) -> int:
            async with client(app) as c:
                r = await c.post("/v1/chat/completions", json=chat_body(), headers=list(headers))
                return r.status_code

        assert await post([("authorization", f"Bearer {KEY}")]) == 429  # alpha is at $0
        assert await post([("x-api-key", KEY)]) == 429  # whichever header carries it
        assert await post([("api-key", "sk-team-only")]) == 200  # the team has no limit
        assert await post([("authorization", "Bearer sk-unknown")]) == 401
        assert await post([]) == 401
        # Alpha's key beside another one is not alpha's: refused as unknown, not charged.
        assert await post([("authorization", "Bearer sk-team-only"), ("x-api-key", KEY)]) == 401
    finally:
        await guard.stop()
