"""Who a request bills within its team (its end user), what it is for (its tags) and the
organisation above its team (its customer), from the sources the settings trust (design.md,
"End users, tags and customers").

The app decides what it trusts: by default only its own request state
(``request.state.spendguard_end_user``, ``request.state.spendguard_tags``), which its auth
sets. A header its own auth or proxy sets can be named instead (``header:<name>``). The
client's own ``user`` / ``safety_identifier`` body fields are a source only when listed
(``body``): any client can send any value there, so a limit per end user taken from them
limits nothing a client cannot dodge by changing the value. ``body:<path>`` names one body
field (dotted: ``metadata.tags``), for a gateway whose own auth writes it or whose clients
it trusts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..engine.decision import InferenceRequest
from .request import BadRequest

__all__ = [
    "MAX_PARTY_LENGTH",
    "MAX_TAGS",
    "STATE_CUSTOMER",
    "STATE_END_USER",
    "STATE_TAGS",
    "Parties",
    "party_of",
    "tags_of",
]

STATE_END_USER: Final = "spendguard_end_user"
STATE_TAGS: Final = "spendguard_tags"
STATE_CUSTOMER: Final = "spendguard_customer"
MAX_PARTY_LENGTH: Final = 256  # characters of an end user or a tag
MAX_TAGS: Final = 16  # tags of one request: each is a bucket checked in the round
_BODY_FIELDS: Final = ("user", "safety_identifier")


def _header(headers: Sequence[tuple[bytes, bytes]], name: str) -> str | None:
    wanted = name.encode("latin-1")
    for key, value in headers:
        if key == wanted:
            return value.decode("latin-1")
    return None


def _checked(value: object, what: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a string.")
    if len(value) > MAX_PARTY_LENGTH:
        raise BadRequest(f"{what} is longer than {MAX_PARTY_LENGTH} characters.")
    return value


def _at(body: Mapping[str, Any] | None, path: str) -> object:
    """The value at a dotted ``path`` of the body (None where it has none)."""
    found: object = body
    for part in path.split("."):
        if not isinstance(found, Mapping):
            return None
        found = found.get(part)
    return found


def party_of(
    sources: Sequence[str],
    state: Mapping[str, Any],
    headers: Sequence[tuple[bytes, bytes]],
    body: Mapping[str, Any] | None,
    *,
    key: str = STATE_END_USER,
    what: str = "end user",
) -> str | None:
    """A request's end user (or, with ``key`` and ``what``, another party named the same
    way: its customer): the first source that names one; None when none does. BadRequest
    for a value that can't be one (not text, too long)."""
    for source in sources:
        if source == "state":
            found = _checked(state.get(key), f"The request's {what}")
        elif source == "body":
            found = None
            for field in _BODY_FIELDS:
                found = _checked(None if body is None else body.get(field), f"'{field}'")
                if found is not None:
                    break
        elif source.startswith("body:"):
            path = source[5:]
            found = _checked(_at(body, path), f"'{path}'")
        else:
            name = source.partition(":")[2]
            found = _checked(_header(headers, name), f"The {name} header")
        if found is not None:
            return found
    return None


def tags_of(
    sources: Sequence[str],
    state: Mapping[str, Any],
    headers: Sequence[tuple[bytes, bytes]],
    body: Mapping[str, Any] | None = None,
) -> tuple[str, ...]:
    """The tags of a request, from the first source that gives any (in order, each once)."""
    for source in sources:
        raw: object
        if source == "state":
            raw = state.get(STATE_TAGS)
            what = "request.state.spendguard_tags"
        elif source.startswith("body:"):
            raw = _at(body, source[5:])
            what = f"'{source[5:]}'"
        else:
            name = source.partition(":")[2]
            header = _header(headers, name)
            raw = None if header is None else [t.strip() for t in header.split(",")]
            what = f"The {name} header"
        if raw is None:
            continue
        if isinstance(raw, str) or not isinstance(raw, Sequence):
            raise BadRequest(f"{what} must be a list of tags.")
        tags = tuple(dict.fromkeys(t for t in (_checked(v, "A tag") for v in raw) if t))
        if len(tags) > MAX_TAGS:
            raise BadRequest(f"A request carries at most {MAX_TAGS} tags.")
        if tags:
            return tags
    return ()


class Parties:
    """The settings' sources, applied to a parsed request (its ``end_user`` and ``tags``)."""

    __slots__ = ("_body", "_customer", "_end_user", "_tags")

    def __init__(
        self,
        end_user_from: Sequence[str],
        tags_from: Sequence[str],
        customer_from: Sequence[str] = ("state",),
    ) -> None:
        self._end_user, self._tags = tuple(end_user_from), tuple(tags_from)
        self._customer = tuple(customer_from)
        self._body = any(
            s.startswith("body") for s in (*self._end_user, *self._tags, *self._customer)
        )

    def apply(
        self,
        request: InferenceRequest,
        state: Mapping[str, Any],
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """Set ``request``'s end user, tags and customer; BadRequest for values that can't be
        them."""
        parsed = None
        if self._body:
            loaded = json.loads(body)  # parse_request accepted it: a JSON object
            parsed = loaded if isinstance(loaded, dict) else None
        request.end_user = party_of(self._end_user, state, headers, parsed)
        request.tags = tags_of(self._tags, state, headers, parsed)
        request.customer = party_of(
            self._customer, state, headers, parsed, key=STATE_CUSTOMER, what="customer"
        )
