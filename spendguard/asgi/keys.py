"""API keys in the headers the SDKs send, for an identity resolver that maps keys to identities.

A gateway whose own auth runs inside the app (a FastAPI dependency, as in LiteLLM) leaves the
middleware nothing in the request state. When the gateway's keys can be looked up outside its
auth (a static table, a cache, the gateway's own key store), a resolver can find the identity
from the key the client sent::

    from spendguard.asgi.keys import from_api_key, hashed_key

    TEAMS = {hashed_key("sk-..."): ("platform", "ci")}  # or an async lookup in your key store
    app.add_middleware(
        SpendGuardMiddleware, resolve_identity=from_api_key(lambda key: TEAMS.get(hashed_key(key)))
    )

The headers read (:data:`KEY_HEADERS`) are those of the official SDKs: ``Authorization:
Bearer <key>`` (OpenAI, and most others), ``x-api-key`` (Anthropic) and ``api-key`` (Azure
OpenAI). A request whose headers carry two *different* keys gets no key at all: which one the
gateway's auth believes is the gateway's business, and charging the other would let a client
spend on a key it did not authenticate with. Then the resolver finds no identity, and the
middleware answers 401 (or passes, with ``SPENDGUARD_MISSING_IDENTITY=allow``).

A key that a lookup does not know is no identity either: ``lookup`` returns None for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from starlette.requests import HTTPConnection

from .identity import IdentityLike, IdentityResolver

KEY_HEADERS: tuple[str, ...] = ("authorization", "x-api-key", "api-key")
"""Headers :func:`api_key_from_headers` reads by default (``authorization`` as a Bearer token)."""

KeyLookup = Callable[[str], IdentityLike | Awaitable[IdentityLike]]
"""A key's identity: an ``Identity``, a ``(team, api_key)`` pair or None, or an awaitable of one."""

_BEARER = "bearer "


def _scope_of(conn_or_scope: HTTPConnection | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(conn_or_scope, HTTPConnection):
        return conn_or_scope.scope
    return conn_or_scope


def _key_in(name: bytes, value: bytes) -> str | None:
    text = value.decode("latin-1").strip()
    if text[: len(_BEARER)].lower() == _BEARER:
        text = text[len(_BEARER) :].strip()
    elif name == b"authorization":
        return None  # another scheme (Basic, Digest...) carries no API key
    return text or None


def api_key_from_headers(
    conn_or_scope: HTTPConnection | Mapping[str, Any], *, headers: Iterable[str] = KEY_HEADERS
) -> str | None:
    """The API key of a request: from an ``HTTPConnection`` or an ASGI scope's raw headers.

    ``Authorization`` counts only as ``Bearer <key>`` (any case of the scheme); in the other
    headers a value is the key itself (a ``Bearer`` prefix is dropped there too). Empty values
    count as absent. None when no header carries a key, or when they carry different keys
    (see the module's docstring). ``headers`` names the headers to read, case-insensitively,
    e.g. ``KEY_HEADERS + ("x-goog-api-key",)``.
    """
    names = frozenset(h.lower().encode("latin-1") for h in headers)
    found: str | None = None
    for name, value in _scope_of(conn_or_scope).get("headers") or ():
        lowered = bytes(name).lower()
        if lowered not in names:
            continue
        key = _key_in(lowered, bytes(value))
        if key is None:
            continue
        if found is not None and key != found:
            return None  # two different keys: ambiguous
        found = key
    return found


def hashed_key(key: str) -> str:
    """The hex SHA-256 of ``key``'s UTF-8 bytes: how LiteLLM stores (and names) its keys.

    A table of hashes keeps the keys themselves out of the resolver's memory and logs;
    ``UserAPIKeyAuth.token`` and the ``token`` column of LiteLLM's key table hold the same value.
    """
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def from_api_key(lookup: KeyLookup, *, headers: Iterable[str] = KEY_HEADERS) -> IdentityResolver:
    """A resolver: the request's API key (:func:`api_key_from_headers`) through ``lookup``.

    ``lookup(key)`` is sync or async and returns an ``Identity``, a ``(team, api_key)`` pair
    or None (an unknown key). No key in the headers: no identity, ``lookup`` is not called.
    A lookup that raises counts as no identity (the middleware logs it).
    """
    names = tuple(headers)

    def resolver(conn: HTTPConnection) -> IdentityLike | Awaitable[IdentityLike]:
        key = api_key_from_headers(conn, headers=names)
        if key is None:
            return None
        return lookup(key)  # an awaitable is awaited by the middleware

    name = getattr(lookup, "__qualname__", None) or type(lookup).__name__
    resolver.__name__ = resolver.__qualname__ = f"from_api_key({name})"
    return resolver
