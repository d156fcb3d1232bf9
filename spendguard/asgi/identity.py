"""Identity resolvers: the team and API key of a request, from the host app's auth state.

Headers are never consulted: identity comes from the app's own authentication.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import HTTPConnection

from ..identity import Identity

log = logging.getLogger("spendguard")

IdentityLike = Identity | tuple[str, str | None] | None
IdentityResolver = Callable[[HTTPConnection], IdentityLike | Awaitable[IdentityLike]]

STATE_TEAM = "team_id"
STATE_API_KEY = "api_key_id"
STATE_IDENTITY = "spendguard_identity"


# Identities made from (team, key) pairs, by pair: a gateway sees the same few thousand again
# and again, and an Identity (frozen) is made once for each. Emptied when full.
_MADE: dict[tuple[str, str | None], Identity] = {}
_MAX_MADE = 16_384
_PLAIN_KEY = (str, type(None))


def _coerce(value: object) -> Identity | None:
    if type(value) is tuple:
        # Only pairs already validated are in _MADE: a hit of plain strings needs no other
        # check (members of a str subclass may equal a cached pair and still be their own).
        try:
            made = _MADE.get(value)
        except TypeError:  # an unhashable member: not a valid pair either
            return None
        if made is not None and type(value[0]) is str and type(value[1]) in _PLAIN_KEY:
            return made
    if value is None:
        return None
    if isinstance(value, Identity):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        team, key = value
        if isinstance(team, str) and team and (key is None or (isinstance(key, str) and key)):
            if type(value) is not tuple or type(team) is not str or type(key) not in _PLAIN_KEY:
                return Identity(team, key)  # subclasses: their hash and equality are their own
            made = _MADE.get(value)
            if made is None:
                if len(_MADE) >= _MAX_MADE:
                    _MADE.clear()
                made = _MADE[value] = Identity(team, key)
            return made
    return None


def from_auth_state(conn: HTTPConnection) -> Identity | None:
    """Default resolver: read what the host's auth middleware left in the scope.

    Looks at ``scope["state"]`` (``request.state.spendguard_identity`` or
    ``request.state.team_id`` / ``api_key_id``), then at ``scope["user"]`` attributes of the
    same names (Starlette's AuthenticationMiddleware). Headers are never consulted.
    """
    state: Mapping[str, Any] = conn.scope.get("state") or {}
    found = _coerce(state.get(STATE_IDENTITY))
    if found is not None:
        return found
    found = _coerce((state.get(STATE_TEAM), state.get(STATE_API_KEY)))
    if found is not None:
        return found
    user = conn.scope.get("user")
    if user is not None:
        return _coerce((getattr(user, STATE_TEAM, None), getattr(user, STATE_API_KEY, None)))
    return None


def from_user(team: str, api_key: str | None = None) -> IdentityResolver:
    """A resolver reading the authenticated user's own attribute names.

    For an ``AuthenticationMiddleware`` whose user object calls them something other than
    ``team_id`` / ``api_key_id``::

        SpendGuardMiddleware(app, resolve_identity=from_user(team="org", api_key="key_name"))
    """

    def resolver(conn: HTTPConnection) -> IdentityLike:
        user = conn.scope.get("user")
        if user is None:
            return None
        key = getattr(user, api_key, None) if api_key is not None else None
        return _coerce((getattr(user, team, None), key))

    resolver.__name__ = resolver.__qualname__ = f"from_user(team={team!r}, api_key={api_key!r})"
    return resolver


async def resolve(resolver: IdentityResolver | None, conn: HTTPConnection) -> Identity | None:
    """Run a sync or async resolver; anything that is not a usable identity counts as none."""
    if resolver is None:
        return from_auth_state(conn)
    try:
        value = resolver(conn)
        if type(value) is not tuple and inspect.isawaitable(value):  # a tuple: the usual answer
            value = await value
        return _coerce(value)
    except Exception:
        # A resolver that raises (say, a KeyError on an unauthenticated request) has found
        # no identity: the client gets a clear 401, not a 500, and the cause is logged.
        log.warning("spendguard identity resolver failed; treating as no identity", exc_info=True)
        return None
