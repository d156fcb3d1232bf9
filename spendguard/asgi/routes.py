"""Which requests are inferences, and which provider dialect their errors speak.

A route is an exact path (``/v1/chat/completions``) or a pattern with path parameters in
Starlette's syntax (``/openai/deployments/{model}/chat/completions``, ``/llm/{rest:path}``). A
parameter named ``model`` or ``deployment`` names the model when the body has none (Azure's
deployments, ``/engines/{model}/...``).

Matching is on the path the app and its upstream will act on, not on its spelling: repeated
slashes collapse, ``.`` and ``..`` segments resolve (RFC 3986; ``..`` never climbs above the
root), a trailing slash and percent-encoding (an encoded ``/`` included, and encoding applied
twice) are read as the plain path, a backslash as a slash, letters in either case. A path that
stays ambiguous after that (still percent-encoded after three decodings, or holding control
characters) is :data:`AMBIGUOUS`: the middleware refuses it with a 400 rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, NamedTuple
from urllib.parse import unquote

from starlette.convertors import CONVERTOR_TYPES
from starlette.routing import compile_path
from starlette.types import Scope

from ..usage import Dialect

_PARAM: Final = re.compile(r"\{([^{}]*)\}")
_PARAM_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(:[A-Za-z_][A-Za-z0-9_]*)?")
# Path parameters that name the model the upstream runs.
MODEL_PARAMETERS: Final = ("model", "deployment", "deployment_id", "engine", "model_id")
# Spellings that need the slow path: anything a server, a router or an upstream client may
# read differently from the characters as they stand.
_UNUSUAL: Final = re.compile(r"//|/\.|%|\\|[A-Z]|/$")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_DECODINGS: Final = 3
# Last path segments of the APIs spendguard reads usage from.
INFERENCE_ENDINGS: Final = ("/completions", "/responses", "/embeddings", "/messages", "/compact")
# A route recorded with a record is the path as requested; a pattern can match a long one.
MAX_ROUTE_LENGTH: Final = 256


class RouteMatch(NamedTuple):
    route: str  # the canonical path (as recorded), or the configured exact route
    dialect: Dialect
    model: str | None = None  # from the path's model parameter, if the route has one


# A path that can't be read one way only (see the module docstring).
AMBIGUOUS: Final = RouteMatch("", Dialect.OPENAI)


def route_pattern(path: str) -> re.Pattern[str] | None:
    """The compiled pattern of a route with path parameters; None for an exact path.

    Raises ValueError naming the problem (an unknown convertor, a stray brace).
    """
    if "{" not in path and "}" not in path:
        return None
    for param in _PARAM.findall(path):
        if not _PARAM_NAME.fullmatch(param):
            raise ValueError(f"{path!r}: {{{param}}} is not a path parameter")
        convertor = param.partition(":")[2]
        if convertor and convertor not in CONVERTOR_TYPES:
            known = ", ".join(sorted(CONVERTOR_TYPES))
            raise ValueError(f"{path!r}: unknown path convertor {convertor!r} (known: {known})")
    if "{" in _PARAM.sub("", path) or "}" in _PARAM.sub("", path):
        raise ValueError(f"{path!r}: unbalanced braces")
    return re.compile(compile_path(path)[0].pattern, re.IGNORECASE)


def dialect_of(path: str) -> Dialect:
    """Paths ending in ``/messages`` speak Anthropic's error format."""
    return Dialect.ANTHROPIC if path.rsplit("/", 1)[-1].lower() == "messages" else Dialect.OPENAI


def canonical_path(path: str) -> str | None:
    """The path as the app's router or an upstream client resolves it; None: ambiguous."""
    for _ in range(_DECODINGS):
        if "%" not in path:
            break
        try:
            decoded = unquote(path, errors="strict")
        except UnicodeDecodeError:
            return None  # not text: no two readers agree on what it spells
        if decoded == path:
            break
        path = decoded
    else:
        if "%" in path and unquote(path) != path:
            return None  # encoded more times than anyone decodes it
    if _CONTROL.search(path):
        return None
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment == ".." and segments:
            segments.pop()
        elif segment not in ("", ".", ".."):
            segments.append(segment)
    return "/" + "/".join(segments)


def _last_literal(path: str) -> str:
    """The last segment of a route, lower-cased, or "" when it is a parameter."""
    last = path.rsplit("/", 1)[-1]
    return "" if "{" in last else last.lower()


class RouteTable:
    """Exact-path lookup: one dict probe per request keeps non-inference traffic untouched.

    Paths are compared relative to the app's ``root_path``, so a gateway mounted under a prefix
    matches the same routes; a route written with the mount's prefix
    (``/llm/v1/chat/completions``) matches too. A path spelled in any unusual way (see the
    module docstring) and the patterns are tried only when no exact path matched.
    """

    __slots__ = ("_exact", "_folded", "_patterns", "paths")

    def __init__(self, paths: Iterable[str]) -> None:
        self._exact: dict[str, RouteMatch] = {}
        self._folded: dict[str, RouteMatch] = {}  # by the lower-cased canonical path
        # By the route's last literal segment ("" for those ending in a parameter), each with
        # the lower-cased literal text before its first parameter: a prefix test rules most
        # patterns out before their regex runs.
        self._patterns: dict[str, list[tuple[str, re.Pattern[str]]]] = {}
        self.paths: tuple[str, ...] = ()
        for path in paths:
            norm = path.rstrip("/") or "/"
            if norm in self.paths:
                continue
            self.paths += (norm,)
            pattern = route_pattern(norm)
            if pattern is None:
                match = RouteMatch(norm, dialect_of(norm))
                self._exact[norm] = match
                self._folded.setdefault((canonical_path(norm) or norm).lower(), match)
            else:
                head = norm.split("{", 1)[0].lower()
                self._patterns.setdefault(_last_literal(norm), []).append((head, pattern))

    def match(self, scope: Scope) -> RouteMatch | None:
        """The route of a POST request; None: not an inference route; :data:`AMBIGUOUS`: a
        path that can't be read one way only."""
        if scope["method"] != "POST":
            return None
        return self.lookup(scope)

    def lookup(self, scope: Scope) -> RouteMatch | None:
        """:meth:`match` for a request of any method."""
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        found = self._exact.get(path)
        if found is not None:
            return found
        if root or self._patterns or _UNUSUAL.search(path):
            return self.match_path(path, scope["path"], root)
        return None

    def match_path(self, path: str, full: str | None = None, root: str = "") -> RouteMatch | None:
        """The slower cases: any spelling of a path, the full path under a mount, patterns."""
        canonical = canonical_path(path)
        if canonical is None:
            return AMBIGUOUS
        candidates = [canonical]
        if full is not None and full != path:
            whole = canonical_path(full)
            if whole is None:
                return AMBIGUOUS
            if root and (base := canonical_path(root)) and whole.startswith(base.rstrip("/") + "/"):
                candidates.append(whole[len(base.rstrip("/")) :])
            candidates.append(whole)
        for candidate in candidates:
            found = self._folded.get(candidate.lower())
            if found is not None:
                return found
        for candidate in candidates:
            found = self._match_pattern(candidate)
            if found is not None:
                return found
        return None

    def _match_pattern(self, path: str) -> RouteMatch | None:
        if not self._patterns:
            return None
        folded = path.lower()
        for key in (_last_literal(path), ""):
            for head, pattern in self._patterns.get(key, ()):
                if not folded.startswith(head):
                    continue
                hit = pattern.match(path)
                if hit is not None:
                    params = hit.groupdict()
                    model = next((params[n] for n in MODEL_PARAMETERS if params.get(n)), None)
                    return RouteMatch(path[:MAX_ROUTE_LENGTH], dialect_of(path), model)
        return None
