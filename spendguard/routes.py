"""Which requests are inferences, and which provider dialect their errors speak."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Scope

from .usage import Dialect as Dialect  # defined with the formats it names; re-exported here


class RouteTable:
    """Exact-path lookup: one dict probe per request keeps non-inference traffic untouched.

    Paths are compared without a trailing slash and relative to the app's ``root_path``, so a
    gateway mounted under a prefix matches the same routes.
    """

    __slots__ = ("_routes",)

    def __init__(self, paths: Iterable[str]) -> None:
        self._routes: dict[str, Dialect] = {}
        for path in paths:
            norm = path.rstrip("/") or "/"
            last = norm.rsplit("/", 1)[-1]
            self._routes[norm] = Dialect.ANTHROPIC if last == "messages" else Dialect.OPENAI

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
        return None if dialect is None else (path, dialect)
