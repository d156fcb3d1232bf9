"""Who is spending: the team and API key of a request, from the host app's authenticated state.

Ids are arbitrary strings from the host app. They reach cache keys and SQL only through
:func:`encode_id`, which is injective and yields a short string of safe characters, so no id
can break the ``{team}`` hash tag, inject a ``:`` or newline into a key name, or collide with
another id (R2.3).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection

log = logging.getLogger("spendguard")

# Characters an encoded id may contain as themselves. Everything else (including `%`, `~`,
# `{`, `}`, `:` and whitespace) is percent-encoded from its UTF-8 bytes, which keeps the
# mapping injective: two different strings never share an encoding. NFC and NFD spellings of
# the same text are different strings and stay different ids (the host app decides identity).
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.@")
# Longer encodings are replaced by a digest so keys and SQL index entries stay small; the `~`
# prefix can never come out of percent-encoding, so a digest never equals a plain encoding.
MAX_ENCODED_LEN = 96


def encode_id(raw: str) -> str:
    if not raw:
        raise ValueError("empty id")
    data = raw.encode("utf-8", "surrogatepass")
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in data)
    if len(out) > MAX_ENCODED_LEN:
        return "~" + hashlib.sha256(data).hexdigest()
    return out


@dataclass(frozen=True, slots=True)
class Identity:
    """A team and optionally one of its API keys, with their encoded (key-safe) forms."""

    team_id: str
    api_key_id: str | None = None
    team: str = field(init=False)
    api_key: str | None = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.team_id, str) or not self.team_id:
            raise ValueError("team_id must be a non-empty string")
        if self.api_key_id is not None and (
            not isinstance(self.api_key_id, str) or not self.api_key_id
        ):
            raise ValueError("api_key_id must be a non-empty string or None")
        object.__setattr__(self, "team", encode_id(self.team_id))
        object.__setattr__(
            self, "api_key", None if self.api_key_id is None else encode_id(self.api_key_id)
        )


IdentityLike = Identity | tuple[str, str | None] | None
IdentityResolver = Callable[[HTTPConnection], IdentityLike | Awaitable[IdentityLike]]

STATE_TEAM = "team_id"
STATE_API_KEY = "api_key_id"
STATE_IDENTITY = "spendguard_identity"


def _coerce(value: object) -> Identity | None:
    if value is None:
        return None
    if isinstance(value, Identity):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        team, key = value
        if isinstance(team, str) and team and (key is None or (isinstance(key, str) and key)):
            return Identity(team, key)
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


async def resolve(resolver: IdentityResolver | None, conn: HTTPConnection) -> Identity | None:
    """Run a sync or async resolver; anything that is not a usable identity counts as none."""
    if resolver is None:
        return from_auth_state(conn)
    try:
        value = resolver(conn)
        if inspect.isawaitable(value):
            value = await value
        return _coerce(value)
    except Exception:
        # A resolver that raises (say, a KeyError on an unauthenticated request) has found
        # no identity: the client gets a clear 401, not a 500, and the cause is logged.
        log.warning("spendguard identity resolver failed; treating as no identity", exc_info=True)
        return None
