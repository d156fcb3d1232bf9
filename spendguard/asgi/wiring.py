"""Checks of how the middleware is wired into the app, made once: no silent setup traps.

At the app's lifespan startup (or, without one, on the first request) the middleware looks at
the app it wraps:

- it logs where the ledger and the store are;
- it matches the configured inference routes against the app's real routes, mounts included,
  and warns about a configured route that matches nothing and about an app route that looks
  like an inference route but is not configured (both would pass unlimited and unrecorded);
- it notes the routes whose admission waits for ``Depends(spendguard_guard)``;
- without a lifespan (a mounted sub-app: Starlette sends lifespan events only to the top
  app) it says so on the first inference request and starts the record writer and the
  settlement worker itself.

The first inference request without an identity is explained once: what was looked for,
what was found, how to fix it. Nothing here runs again after the first time.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.routing import Host, Mount, WebSocketRoute, compile_path
from starlette.types import Scope

from ..describe import default_database, ledger_description, store_description
from ..engine.guard import SpendGuard
from ..settings import DEFAULT_ROUTES, MissingIdentity, Settings, Unlisted
from .dependency import STATE_ADMIT, spendguard_guard
from .identity import STATE_API_KEY, STATE_IDENTITY, STATE_TEAM, IdentityResolver
from .routes import INFERENCE_ENDINGS, MODEL_PARAMETERS, RouteTable

log = logging.getLogger("spendguard")

# What a path parameter stands for when a configured pattern is tried against the app's routes.
_SAMPLES = {"int": "1", "float": "1.5", "uuid": "00000000-0000-0000-0000-000000000000"}
_PARAM = re.compile(r"\{([^{}:]+)(?::([^{}]+))?\}")
_PARAM_NAMES = re.compile(r"\{([^{}]+)\}")
_RECHECK_EVERY = 1.0  # seconds: a re-walk of the app's routes, at most this often
_background: set[asyncio.Task[None]] = set()  # detached starts, referenced until they end


@dataclass(frozen=True, slots=True)
class AppRoute:
    """One route of the app, with its full path relative to the app the middleware wraps."""

    path: str
    methods: frozenset[str] | None  # None: any method (a mounted app spendguard can't see into)
    pattern: re.Pattern[str]
    guarded: bool = False  # lists Depends(spendguard_guard)

    @property
    def takes_post(self) -> bool:
        return self.methods is None or "POST" in self.methods


def sample_path(template: str) -> str:
    """A concrete path a template matches (``{deployment}`` becomes ``x``)."""
    return _PARAM.sub(lambda m: _SAMPLES.get(m.group(2) or "", "x"), template)


def _routes_of(obj: object) -> list[Any] | None:
    """The route list of an app, through any middleware wrapped around it."""
    for _ in range(32):
        if obj is None:
            return None
        routes = getattr(obj, "routes", None)
        if isinstance(routes, list):
            return routes
        obj = getattr(obj, "app", None)
    return None


def app_routes(*apps: object) -> list[AppRoute] | None:
    """The routes of the first of ``apps`` that has a route table (None: none has)."""
    for app in apps:
        routes = _routes_of(app)
        if routes is not None:
            return list(_walk(routes, ""))
    return None


def _walk(routes: Iterable[Any], prefix: str) -> Iterator[AppRoute]:
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if callable(contexts):
            # FastAPI >= 0.137: an included router stays one node; its routes, with the
            # include's prefix and dependencies applied, are its effective contexts.
            yield from _walk_included(contexts(), prefix)
            continue
        if isinstance(route, WebSocketRoute) or "WebSocket" in type(route).__name__:
            continue
        if isinstance(route, (Mount, Host)):
            under = prefix + (route.path if isinstance(route, Mount) else "")
            inner = _routes_of(route.app)
            if inner is None:  # an opaque ASGI app: everything under the prefix
                catch_all = f"{under}/{{path:path}}"
                yield AppRoute(catch_all, None, compile_path(catch_all)[0])
            else:
                yield from _walk(inner, under)
            continue
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue
        methods = getattr(route, "methods", None)
        full = prefix + path
        yield AppRoute(
            full,
            frozenset(methods) if methods else None,
            compile_path(full)[0],
            _lists_guard(getattr(route, "dependant", None)),
        )


def _walk_included(contexts: Iterable[Any], prefix: str) -> Iterator[AppRoute]:
    """An included router's routes. A context carries the route's own names (``path``,
    ``methods``, ``dependant``) with the include applied, so it is walked as a route; a plain
    Starlette route or a mount inside the router comes as its ``starlette_route``."""
    for context in contexts:
        original = getattr(context, "original_route", None)
        if "WebSocket" in type(original).__name__:
            continue
        inner = getattr(context, "starlette_route", None)
        if inner is None and not getattr(context, "path", None):
            inner = original
        yield from _walk([context if inner is None else inner], prefix)


def _lists_guard(dependant: Any) -> bool:
    """Whether a FastAPI route's dependencies include ``spendguard_guard`` (at any depth)."""
    stack = [dependant]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if getattr(node, "call", None) is spendguard_guard:
            return True
        stack.extend(getattr(node, "dependencies", ()))
    return False


@dataclass(frozen=True, slots=True)
class RouteReport:
    """The configured inference routes against the app's routes."""

    posts: tuple[str, ...]  # the app's POST routes
    unmatched: tuple[str, ...]  # configured routes that match no POST route of the app
    uncovered: tuple[str, ...]  # app routes that look like inference but match no configured one
    stray: tuple[str, ...]  # app routes with Depends(spendguard_guard) that are not configured
    deferred: tuple[str, ...]  # app routes whose admission waits for Depends(spendguard_guard)
    guarded: tuple[str, ...] = ()  # app POST routes a configured route covers

    @property
    def unmatched_own(self) -> list[str]:
        """The unmatched routes someone configured (the defaults cover more than one app)."""
        return [path for path in self.unmatched if path not in DEFAULT_ROUTES]

    @property
    def ok(self) -> bool:
        return not (self.uncovered or self.stray)


def _looks_like_inference(route: AppRoute) -> bool:
    """An app route an inference would be sent to: its last segment is an inference API's, and
    its parameters, if any, name a model (``/threads/{thread_id}/messages`` is a resource)."""
    if route.methods is None or not route.path.endswith(INFERENCE_ENDINGS):
        return False
    return all(
        name.split(":", 1)[0] in MODEL_PARAMETERS or name.endswith(":path")
        for name in _PARAM_NAMES.findall(route.path)
    )


def route_report(
    table: RouteTable, found: list[AppRoute], passes: RouteTable | None = None
) -> RouteReport:
    posts = [r for r in found if r.takes_post]

    def configured(route: AppRoute, in_table: RouteTable = table) -> bool:
        return in_table.match({"method": "POST", "path": sample_path(route.path)}) is not None

    return RouteReport(
        posts=tuple(r.path for r in posts),
        unmatched=tuple(
            path
            for path in table.paths
            if not any(r.pattern.match(sample_path(path)) for r in posts)
        ),
        uncovered=tuple(
            r.path
            for r in posts
            if _looks_like_inference(r)
            and not configured(r)
            and not (passes is not None and configured(r, passes))
        ),
        # A guard listed router-wide also sits on routes that are no inference: harmless.
        stray=tuple(
            r.path for r in found if r.guarded and _looks_like_inference(r) and not configured(r)
        ),
        deferred=tuple(r.path for r in found if r.guarded and configured(r)),
        guarded=tuple(r.path for r in posts if r.methods is not None and configured(r)),
    )


def _relative_path(scope: Scope) -> str:
    """The request path as the app's router sees it (``root_path`` stripped)."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


class Wiring:
    """The middleware's first-time checks (one per middleware, see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        routes: RouteTable,
        resolver: IdentityResolver | None,
        passes: RouteTable | None = None,
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.resolver = resolver
        self.pending = True  # neither a lifespan nor a request seen yet
        self.unstarted = True  # no lifespan started the guard, nor the first inference
        self.started_by: str | None = None  # "lifespan" or "first request"
        self.passes = passes if passes is not None else RouteTable(settings.pass_routes)
        self._explained = False
        self._deferred: tuple[re.Pattern[str], ...] = ()
        self._seen: frozenset[str] | None = None  # the app routes last checked
        self._warned: set[str] = set()  # routes already warned about
        self._checked_at = -_RECHECK_EVERY
        self._scope_app: object = None

    # -- the first lifespan or request ----------------------------------------------------
    def lifespan(self, scope: Scope, app: object) -> None:
        """The app's lifespan starts: the guard starts with it. Its routes are checked once
        the app's own startup is done (:meth:`started`): the startup may add routes."""
        self.unstarted = False
        self.started_by = "lifespan"

    def started(self, scope: Scope, app: object) -> None:
        """The app's own startup is done: the first check of its routes (on a later lifespan,
        a check of what changed). A request's re-walk is not held back by it."""
        if self.pending:
            self.pending = False
            self.inspect(scope, app)
        else:
            self._check_if_changed(app)

    def first_request(self, scope: Scope, app: object) -> None:
        """The first request, before it is handled."""
        if self.pending:
            self.pending = False
            self.inspect(scope, app)

    async def start_without_lifespan(self, guard: SpendGuard) -> None:
        """The first inference request, and no lifespan ran: start the background tasks (once;
        concurrent first requests do not wait)."""
        if not self.unstarted:
            return
        self.unstarted = False
        if guard.running:  # started by the host app itself (``guard.start()``)
            self.started_by = "the host app"
            return
        self.started_by = "first request"
        log.warning(
            "spendguard got an inference request but never an ASGI lifespan (a mounted sub-app "
            "gets none: Starlette sends lifespan events only to the top app), so it starts its "
            "record writer and settlement worker now, on this first request. To have them "
            "start and stop with the server, add SpendGuardMiddleware to the top app and list "
            "the routes with the mount's prefix in SPENDGUARD_ROUTES (e.g. "
            "/llm/v1/chat/completions)"
        )
        await start_detached(guard)

    def inspect(self, scope: Scope, app: object) -> None:
        """Log where the state lives; check the routes against the app's."""
        settings = self.settings
        where = (
            f"spendguard ledger: {ledger_description(settings)}; "
            f"store: {store_description(settings)}"
        )
        if default_database(settings):
            log.warning(
                "%s (the default ./spendguard.db of the working directory: set "
                "SPENDGUARD_DATABASE_URL so the gateway and the CLI use the same file)",
                where,
            )
        else:
            log.info("%s", where)
        self._scope_app = scope.get("app")
        found = app_routes(self._scope_app, app)
        if found is None:
            log.info("spendguard cannot see the app's routes; the configured routes are unchecked")
            return
        self.check_routes(found)

    def recheck(self, app: object) -> None:
        """Check the app's routes again if they changed (routes added in the app's lifespan,
        or lazily on a first request): at most once a second, and only off the hot path."""
        now = time.monotonic()
        if now - self._checked_at < _RECHECK_EVERY:
            return
        self._checked_at = now
        self._check_if_changed(app)

    def _check_if_changed(self, app: object) -> None:
        found = app_routes(self._scope_app, app)
        if found is not None and frozenset(r.path for r in found) != self._seen:
            self.check_routes(found)

    def check_routes(self, found: list[AppRoute]) -> None:
        first = self._seen is None
        self._seen = frozenset(r.path for r in found)
        report = route_report(self.routes, found, self.passes)
        uncovered = [path for path in report.uncovered if path not in self._warned]
        self._warned.update(uncovered)
        if uncovered:
            log.warning(
                "spendguard: these POST routes of the app look like inference routes but match "
                "no guarded route, so inference-looking requests to them are %s: %s. Guard "
                "them with SPENDGUARD_ROUTES=default,<route> (paths relative to where "
                "SpendGuardMiddleware sits), or list them in SPENDGUARD_PASS_ROUTES",
                "REFUSED (403)"
                if self.settings.unlisted_inference is Unlisted.REFUSE
                else "passed UNLIMITED and UNRECORDED",
                ", ".join(uncovered),
            )
        own = report.unmatched_own
        nothing = not report.guarded and len(report.unmatched) == len(self.routes.paths)
        if first and (own or nothing):
            log.warning(
                "spendguard: these inference routes match no POST route of the app: %s "
                "(the app's POST routes: %s). Paths are relative to where SpendGuardMiddleware "
                "sits; path parameters are written like /openai/deployments/{model}/"
                "chat/completions",
                ", ".join(own or report.unmatched),
                ", ".join(report.posts) or "none",
            )
        stray = [path for path in report.stray if path not in self._warned]
        self._warned.update(stray)
        if stray:
            log.warning(
                "spendguard: routes with Depends(spendguard_guard) that are not guarded "
                "inference routes, so they are NOT limited: %s (add them to SPENDGUARD_ROUTES)",
                ", ".join(stray),
            )
        if first or report.guarded:
            log.info("spendguard guards these routes of the app: %s", ", ".join(report.guarded))
        self._deferred = tuple(r.pattern for r in found if r.guarded)

    def status(self) -> dict[str, object]:
        """What the checks found, for an operator (the hook for a gateway's admin routes and
        ``spendguard doctor``): who started the background tasks ("lifespan", "first request",
        "the host app", or None: not yet), and the deferred routes."""
        return {
            "checked": not self.pending,
            "background_started_by": self.started_by,
            "deferred_routes": [p.pattern for p in self._deferred],
        }

    # -- per request (only on requests that have no identity) ------------------------------
    def defers(self, scope: Scope, app: object = None) -> bool:
        """The request goes to a route whose own dependency resolves the identity (the app's
        routes are checked again first if none does: it may have added the route since)."""
        path = _relative_path(scope)
        if any(p.match(path) for p in self._deferred):
            return True
        if app is None:
            return False
        self.recheck(app)
        return any(p.match(path) for p in self._deferred)

    def no_identity(self, scope: Scope) -> None:
        """Explain, once, why an inference request had no identity and how to fix it."""
        if self._explained:
            return
        self._explained = True
        outcome = (
            "passed through unlimited and unrecorded (SPENDGUARD_MISSING_IDENTITY=allow)"
            if self.settings.missing_identity is MissingIdentity.ALLOW
            else "answered 401"
        )
        log.warning(
            "spendguard: an inference request to %s had no identity and was %s; %s "
            "(this is logged once)",
            scope.get("path"),
            outcome,
            self._why(scope),
        )

    def _why(self, scope: Scope) -> str:
        if self.resolver is not None:
            name = getattr(self.resolver, "__qualname__", repr(self.resolver))
            return f"resolve_identity={name} returned no identity (None, or it raised)"
        state = scope.get("state") or {}
        if STATE_ADMIT in state:  # asked by Depends(spendguard_guard): the app's auth ran
            held = sorted(str(n) for n in state if not str(n).startswith("spendguard_"))
            seen = f" (it holds: {', '.join(held)})" if held else ""
            return (
                "the route lists Depends(spendguard_guard), but the dependencies before it left "
                f"no identity in request.state{seen}: the auth dependency, listed before "
                f"spendguard_guard, must set request.state.{STATE_TEAM}/{STATE_API_KEY} or "
                f"request.state.{STATE_IDENTITY}"
            )
        user = scope.get("user")
        if user is not None and getattr(user, "is_authenticated", True):
            names = sorted(n for n in dir(user) if not n.startswith("_"))
            return (
                f'scope["user"] is a {type(user).__name__} (attributes: {", ".join(names)}) '
                f"without {STATE_TEAM!r}/{STATE_API_KEY!r}: map its own names with "
                'resolve_identity=from_user(team="...", api_key="...")'
            )
        seen = f" (it holds: {', '.join(sorted(map(str, state)))})" if state else ""
        return (
            f"nothing was in request.state{seen}. spendguard reads request.state."
            f"{STATE_IDENTITY}, request.state.{STATE_TEAM}/{STATE_API_KEY} or the same "
            'attributes of scope["user"], set by an auth middleware that runs before it (added '
            "after it). FastAPI Depends auth runs after every middleware: add "
            "Depends(spendguard_guard) after your auth dependency (docs/getting-started.md, "
            '"FastAPI Depends auth"), '
            "or pass SpendGuardMiddleware(resolve_identity=...)"
        )


async def start_detached(guard: SpendGuard) -> None:
    """Start the guard's background tasks in a task of their own (no lifespan owns them).

    They stop with ``guard.stop()``, or when the event loop shuts down and cancels the task:
    the guard then flushes its records, shielded, as at a lifespan shutdown.
    """
    started = anyio.Event()

    async def host() -> None:
        try:
            async with anyio.create_task_group() as tg:
                await guard.start(task_group=tg)
                started.set()
            # The background tasks ended: someone called guard.stop().
        except Exception:
            log.exception("spendguard failed to start on the first request")
        finally:
            started.set()
            if guard.running:
                with anyio.CancelScope(shield=True):
                    await guard.stop()

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio (the tests run on asyncio)
        importlib.import_module("trio").lowlevel.spawn_system_task(host)
    else:
        task = loop.create_task(host(), name="spendguard background")
        _background.add(task)
        task.add_done_callback(_background.discard)
    await started.wait()
