"""``spendguard doctor``: what spendguard would use, and whether it can reach it.

Each check is one entry of :data:`CHECKS`, an async function from the doctor's context to a
:class:`Finding`: the effective settings (secrets redacted), the ledger database, the store,
and the route table (matched against a gateway app's routes when one is named with
``--app module:attribute``). Nothing is created or changed: a SQLite file that does not exist
is reported, not made.

With ``--gateway URL`` (where a running gateway mounts its admin routes, e.g.
``http://127.0.0.1:8000/admin/spendguard``) one more check reads that gateway's
``GET /status`` with ``SPENDGUARD_ADMIN_TOKEN``: whether its lifespan ran (or the background
tasks started lazily on the first inference request, or not at all), whether its record
writer and settlement worker run, the records not yet written, and its store mode.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from .asgi.routes import RouteTable
from .asgi.wiring import app_routes, route_report
from .describe import ledger_description, redact_url, sqlite_file, store_description
from .errors import ConfigurationError, SpendGuardError
from .ledger import Ledger
from .settings import Settings
from .store import make_store


@dataclass(frozen=True, slots=True)
class Finding:
    check: str  # settings, database, store, routes
    ok: bool
    detail: str  # one line for people
    data: dict[str, Any] = field(default_factory=dict)  # for --json


@dataclass(frozen=True, slots=True)
class DoctorContext:
    settings: Settings
    app: str | None = None  # "module:attribute" of the gateway app, to check its routes
    gateway: str | None = None  # base URL of a running gateway's admin routes


Check = Callable[[DoctorContext], Awaitable[Finding]]


def effective_settings(settings: Settings) -> dict[str, Any]:
    """Every setting as it is in effect, URLs with their passwords redacted and the admin
    token replaced by ``***`` (None: not set)."""
    data = settings.model_dump(mode="json")
    data["database_url"] = redact_url(settings.database_url.get_secret_value())
    if settings.redis_url is not None:
        data["redis_url"] = redact_url(settings.redis_url.get_secret_value())
    data["admin_token"] = None if settings.admin_token is None else "***"
    return data


async def check_settings(ctx: DoctorContext) -> Finding:
    data = effective_settings(ctx.settings)
    return Finding("settings", True, f"{len(data)} settings in effect", data)


async def check_database(ctx: DoctorContext) -> Finding:
    settings = ctx.settings
    where = ledger_description(settings)
    path = sqlite_file(settings)
    if path is not None and not path.exists():
        return Finding(
            "database",
            False,
            f"SQLite file {path} does not exist: a gateway or a CLI command would create it "
            "empty there",
            {"url": redact_url(settings.database_url.get_secret_value()), "exists": False},
        )
    ledger = Ledger(settings.database_url.get_secret_value())
    data: dict[str, Any] = {"url": redact_url(settings.database_url.get_secret_value())}
    try:
        with anyio.fail_after(settings.db_timeout):
            await ledger.connect()
            await ledger.ping()
    except (SpendGuardError, TimeoutError, OSError) as exc:
        return Finding("database", False, f"{where}: unreachable ({exc})", data)
    finally:
        await ledger.disconnect()
    return Finding("database", True, f"{where}: reachable", data)


async def check_store(ctx: DoctorContext) -> Finding:
    settings = ctx.settings
    where = store_description(settings)
    if settings.redis_url is None:
        return Finding("store", True, f"{where}: nothing to reach", {"url": None})
    data = {"url": redact_url(settings.redis_url.get_secret_value())}
    store = make_store(settings)
    try:
        ping = getattr(store, "ping", None)
        if ping is not None:
            await ping()
    except SpendGuardError as exc:
        return Finding("store", False, f"{where}: unreachable ({exc})", data)
    finally:
        await store.aclose()
    return Finding("store", True, f"{where}: reachable", data)


def load_app(target: str) -> object:
    """The object ``module:attribute`` names (as uvicorn finds an app)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"--app {target!r}: use module:attribute (e.g. gateway:app)")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the working directory, as uvicorn does
    try:
        app: object = importlib.import_module(module_name)
        for name in attribute.split("."):
            app = getattr(app, name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--app {target!r}: {exc}") from exc
    return app


async def check_routes(ctx: DoctorContext) -> Finding:
    """The guarded routes against the app's: every inference-looking POST route of the app
    must be guarded or a pass route (else: not ok, and ``doctor`` exits 1)."""
    routes = ctx.settings.routes
    table = RouteTable(routes)
    data: dict[str, Any] = {"configured": list(routes)}
    if ctx.app is None:
        return Finding("routes", True, f"{len(routes)} routes guarded (no --app to check)", data)
    found = app_routes(load_app(ctx.app))
    if found is None:
        return Finding("routes", False, f"{ctx.app} has no route table to check", data)
    report = route_report(table, found, RouteTable(ctx.settings.pass_routes))
    own_unmatched = report.unmatched_own
    data.update(
        app_post_routes=list(report.posts),
        guarded=list(report.guarded),
        unmatched=own_unmatched,
        uncovered=list(report.uncovered),
        stray=list(report.stray),
        deferred=list(report.deferred),
    )
    problems = []
    if report.uncovered:
        problems.append("NOT guarded (inference-looking): " + ", ".join(report.uncovered))
    if report.stray:
        problems.append("Depends(spendguard_guard) on unguarded: " + ", ".join(report.stray))
    if own_unmatched:
        problems.append("configured, matching no app route: " + ", ".join(own_unmatched))
    detail = "; ".join(problems) if problems else "every inference-looking route is guarded"
    guarded = ", ".join(report.guarded) or "none"
    return Finding("routes", report.ok, f"guarded: {guarded}; {detail}", data)


_LIFESPAN_TEXT = {
    "lifespan": "started by the ASGI lifespan",
    "first_request": "started lazily on the first inference request (no lifespan reached it)",
    "host_app": "started by the host app",
    "not_started": "not started (no lifespan ran and no inference request came yet)",
}


async def check_gateway(ctx: DoctorContext) -> Finding:
    """The running gateway at ``ctx.gateway``, through its admin ``GET /status``."""
    assert ctx.gateway is not None
    url = ctx.gateway.rstrip("/") + "/status"
    data: dict[str, Any] = {"url": url}
    token = ctx.settings.admin_token
    if token is None:
        return Finding("gateway", False, "set SPENDGUARD_ADMIN_TOKEN to read its status", data)
    headers = {"authorization": f"Bearer {token.get_secret_value()}"}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            answer = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        return Finding("gateway", False, f"{url}: unreachable ({exc!r})", data)
    data["status_code"] = answer.status_code
    if answer.status_code in (401, 403):
        return Finding("gateway", False, f"{url}: the admin token was refused", data)
    if answer.status_code == 404:
        why = "admin routes off there (no SPENDGUARD_ADMIN_TOKEN) or not mounted at that URL"
        return Finding("gateway", False, f"{url}: 404, {why}", data)
    try:
        status = answer.json()
        state, running = status["lifespan"], status["running"]
    except (ValueError, KeyError, TypeError):
        return Finding("gateway", False, f"{url}: {answer.status_code}, not a status", data)
    data.update(status)
    writer, worker = status.get("record_writer") or {}, status.get("worker") or {}
    store = status.get("store") or {}
    if not status.get("enabled", True):
        return Finding("gateway", False, "spendguard is disabled in the gateway", data)
    parts = [
        _LIFESPAN_TEXT.get(state, str(state)),
        f"record writer {'running' if writer.get('running') else 'NOT running'} "
        f"({_records(writer.get('pending', 0))} pending)",
        f"worker {'running' if worker.get('running') else 'NOT running'}",
        f"store {store.get('mode')}",
    ]
    ok = bool(running and writer.get("running") and worker.get("running"))
    return Finding("gateway", ok, "; ".join(parts), data)


CHECKS: tuple[tuple[str, Check], ...] = (
    ("settings", check_settings),
    ("database", check_database),
    ("store", check_store),
    ("routes", check_routes),
    ("gateway", check_gateway),  # only when a gateway URL is given
)


async def run_checks(ctx: DoctorContext) -> list[Finding]:
    return [
        await check(ctx) for name, check in CHECKS if name != "gateway" or ctx.gateway is not None
    ]


def _records(n: int) -> str:
    """``1 record``, ``2 records``."""
    return f"{n} record{'' if n == 1 else 's'}"
