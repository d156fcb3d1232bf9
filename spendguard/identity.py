"""Who is spending: a team and optionally one of its API keys.

Ids are arbitrary strings from the host app. They reach cache keys and SQL only through
:func:`encode_id`, which is injective and yields a short string of safe characters, so no id
can break the ``{team}`` hash tag, inject a ``:`` or newline into a key name, or collide with
another id. (Where the ids come from, the host app's auth, is ``spendguard.asgi.identity``.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

# Characters an encoded id may contain as themselves. Everything else (including `%`, `~`,
# `{`, `}`, `:` and whitespace) is percent-encoded from its UTF-8 bytes, which keeps the
# mapping injective: two different strings never share an encoding. NFC and NFD spellings of
# the same text are different strings and stay different ids (the host app decides identity).
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.@")
# Longer encodings are replaced by a digest so keys and SQL index entries stay small; the `~`
# prefix can never come out of percent-encoding, so a digest never equals a plain encoding.
MAX_ENCODED_LEN = 96


# Every request encodes its ids; a gateway sees the same few thousand again and again.
@lru_cache(maxsize=16_384)
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
