"""Which requests are inferences, and which provider dialect their errors speak.

A route is an exact path (``/v1/chat/completions``) or a pattern with path parameters in
Starlette's syntax (``/openai/deployments/{deployment}/chat/completions``, ``/llm/{rest:path}``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from starlette.convertors import CONVERTOR_TYPES
from starlette.routing import compile_path
from starlette.types import Scope

from ..usage import Dialect

_PARAM: Final = re.compile(r"\{([^{}]*)\}")
_PARAM_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(:[A-Za-z_][A-Za-z0-9_]*)?")


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
    return compile_path(path)[0]


def dialect_of(path: str) -> Dialect:
    """Paths ending in ``/messages`` speak Anthropic's error format."""
    return Dialect.ANTHROPIC if path.rsplit("/", 1)[-1] == "messages" else Dialect.OPENAI


class RouteTable:
    """Exact-path lookup: one dict probe per request keeps non-inference traffic untouched.

    Paths are compared without a trailing slash and relative to the app's ``root_path``, so a
    gateway mounted under a prefix matches the same routes; a route written with the mount's
    prefix (``/llm/v1/chat/completions``) matches too. Patterns with path parameters are tried
    only when no exact path matched.
    """

    __slots__ = ("_patterns", "_routes", "paths")

    def __init__(self, paths: Iterable[str]) -> None:
        self._routes: dict[str, Dialect] = {}
        self._patterns: list[re.Pattern[str]] = []
        self.paths: tuple[str, ...] = ()
        for path in paths:
            norm = path.rstrip("/") or "/"
            self.paths += (norm,)
            pattern = route_pattern(norm)
            if pattern is None:
                self._routes[norm] = dialect_of(norm)
            else:
                self._patterns.append(pattern)

    def match(self, scope: Scope) -> tuple[str, Dialect] | None:
        if scope["method"] != "POST":
            return None
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/")
        dialect = self._routes.get(path)
        if dialect is not None:
            return path, dialect
        if root or self._patterns:
            return self._match_further(path, scope["path"].rstrip("/") or "/")
        return None

    def _match_further(self, path: str, full: str) -> tuple[str, Dialect] | None:
        """The slower cases: the full path under a mount, and the patterns."""
        if full != path and (dialect := self._routes.get(full)) is not None:
            return full, dialect
        for candidate in (path, full) if full != path else (path,):
            for pattern in self._patterns:
                if pattern.match(candidate):
                    return candidate, dialect_of(candidate)
        return None
