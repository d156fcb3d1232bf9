"""Admin HTTP routes: a Starlette app a gateway mounts (docs/admin-http.md has every route and
JSON shape)::

    app.add_middleware(SpendGuardMiddleware)
    app.mount("/admin/spendguard", admin_app(app))   # the app the middleware was added to

Off unless ``SPENDGUARD_ADMIN_TOKEN`` is set (or ``token=`` is passed): every path then answers
404. With a token, every request needs ``Authorization: Bearer <token>`` (compared in constant
time): none (or another scheme) is a 401 with ``WWW-Authenticate: Bearer``, a wrong one a 403.

The routes are the CLI's operations on the same :class:`~spendguard.engine.admin.Admin`, with
the same checks: ids are the host app's own strings (see ``spendguard.identity``), USD amounts
are decimal strings turned into integer micro-USD, money comes back as exact decimal strings
next to the integers. A change goes to the ledger and drops this process's cached policy (on
Redis, every replica's): it applies from the next request. Bad input is a 4xx JSON error,
``{"error": {"code": ..., "message": ...}}``; a ledger or store that can't be reached a 503.

The app finds the middleware at its first request: ``source`` is the app the middleware was
added to (searched through its middleware stack), the middleware itself, or a
:class:`~spendguard.engine.guard.SpendGuard` (with ``budgets=`` for its budget gate).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..alerts.thresholds import parse_thresholds
from ..budgets.admin import BudgetAdmin
from ..clock import utcnow
from ..describe import redact_url
from ..doctor import effective_settings
from ..engine.admin import Admin, TopReport
from ..engine.budgets import BudgetGate
from ..engine.guard import SpendGuard
from ..engine.views import (
    RATE_FIELDS,
    alert_test_json,
    alerts_json,
    balance_json,
    balance_report_json,
    budget_report_json,
    budget_reset_json,
    model_lists_json,
    policies_json,
    policy_json,
    rates_json,
    removed_json,
    top_json,
    usage_json,
)
from ..errors import ConfigurationError, LedgerUnavailable, SpendGuardError, StoreUnavailable
from ..identity import Identity
from ..ledger.reports import TOP_BY
from ..limits import Period
from ..money import checked_amount, micros_to_usd, usd_to_micros
from ..settings import Settings
from .page import COOKIE, cookie_matches, cookie_value, login_page, spend_page

log = logging.getLogger("spendguard.admin")

# An id in a path: the host app's string as is (braces, unicode and the like are encoded
# safely before they reach a key or SQL), but nothing a path or a log line should not hold.
MAX_PATH_ID = 256
MAX_BODY_BYTES = 64 * 1024
_DOT_SEGMENTS = frozenset({".", ".."})


class AdminError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _error(status: int, code: str, message: str, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=headers
    )


@dataclass(frozen=True, slots=True)
class _Target:
    """What the routes act on, found at the first request."""

    settings: Settings
    guard: SpendGuard | None  # None: the middleware is disabled (SPENDGUARD_ENABLED=false)
    budgets: BudgetGate | None
    wiring: Any  # the middleware's Wiring, or None when given a bare guard


def _find_middleware(source: object) -> Any:
    """The SpendGuardMiddleware in ``source``'s middleware stack (None: not there yet)."""
    from .middleware import SpendGuardMiddleware

    obj: object | None = source
    for _ in range(64):
        if obj is None:
            return None
        if isinstance(obj, SpendGuardMiddleware):
            return obj
        # Starlette/FastAPI build their stack at their first request.
        obj = getattr(obj, "middleware_stack", None) or getattr(obj, "app", None)
    return None


def _path_id(request: Request, name: str) -> str:
    raw = request.path_params[name]
    if not isinstance(raw, str) or not raw:
        raise AdminError(400, "invalid_id", f"empty {name} id")
    if len(raw) > MAX_PATH_ID:
        raise AdminError(400, "invalid_id", f"{name} id longer than {MAX_PATH_ID} characters")
    if raw in _DOT_SEGMENTS:
        raise AdminError(400, "invalid_id", f"{name} id {raw!r} is a dot segment")
    if not raw.isprintable():
        raise AdminError(400, "invalid_id", f"{name} id holds a control character")
    return raw


def _identity(request: Request) -> Identity:
    team = _path_id(request, "team")
    key = _path_id(request, "key") if "key" in request.path_params else None
    try:
        return Identity(team, key)
    except ValueError as exc:
        raise AdminError(400, "invalid_id", str(exc)) from None


def _period(request: Request) -> Period:
    raw = request.path_params["period"]
    try:
        return Period(raw)
    except ValueError:
        names = ", ".join(p.value for p in Period)
        raise AdminError(404, "not_found", f"no period {raw[:40]!r} (periods: {names})") from None


async def _body(request: Request, allowed: set[str], required: set[str]) -> dict[str, Any]:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise AdminError(413, "request_too_large", f"body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError):
        raise AdminError(400, "invalid_json", "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise AdminError(400, "invalid_request", "the body must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise AdminError(
            400,
            "invalid_request",
            f"unknown fields {sorted(unknown)} (fields: {', '.join(sorted(allowed))})",
        )
    missing = required - set(body)
    if missing:
        raise AdminError(400, "invalid_request", f"missing fields: {', '.join(sorted(missing))}")
    return body


def _alert_at(body: dict[str, Any]) -> list[int] | str | None:
    """A policy body's alert_at: absent keeps the limit's thresholds, null goes back to the
    gateway's default, a list of percentages (``[]``: none) sets the limit's own."""
    if "alert_at" not in body:
        return None
    value = body["alert_at"]
    if value is None:
        return "default"
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise AdminError(
            400, "invalid_request", "alert_at must be a list of whole percentages, or null"
        )
    try:
        return list(parse_thresholds(value))
    except ValueError as exc:
        raise AdminError(400, "invalid_request", str(exc)) from None


def _amount(body: dict[str, Any], name: str, what: str, *, allow_zero: bool) -> int:
    """A USD amount given as a decimal string (or an integer): integer micro-USD."""
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise AdminError(400, "invalid_amount", f'{name}: a decimal string such as "5.00"')
    try:
        amount = Decimal(value)
        return checked_amount(usd_to_micros(amount), what, allow_zero=allow_zero)
    except (InvalidOperation, ValueError) as exc:
        message = str(exc) if str(exc) else f"not a USD amount: {str(value)[:40]!r}"
        raise AdminError(400, "invalid_amount", f"{name}: {message}") from None


def _mode(body: dict[str, Any], default: str | None = None) -> bool:
    mode: object = body.get("mode", default)
    if mode not in ("soft", "hard"):
        raise AdminError(400, "invalid_request", 'mode: "soft" or "hard"')
    return mode == "hard"


Handler = Callable[[Request, "_Target"], Awaitable[Response]]


_PAGE_TEAMS = 50  # teams the spend page shows (the biggest spenders first)
_MAX_FORM = 4096


def _route_path(scope: Scope) -> str:
    """The path within this app: after the mount point (Starlette keeps the whole path in
    ``path`` and the mount point in ``root_path``; older releases cut it)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _read_form(request: Request) -> str:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_FORM:
            break
    return body[:_MAX_FORM].decode("utf-8", "replace")


class AdminApp:
    """The ASGI app :func:`admin_app` returns (see the module docstring)."""

    def __init__(
        self,
        source: object,
        *,
        token: str | None = None,
        budgets: BudgetGate | None = None,
    ) -> None:
        self._source = source
        self._token = token
        self._budgets = budgets
        self._target: _Target | None = None
        self._warned = False
        self.router = Starlette(
            routes=[
                Route("/status", self._wrap(self.status), methods=["GET"]),
                Route("/config", self._wrap(self.config), methods=["GET"]),
                Route("/policies", self._wrap(self.all_policies), methods=["GET"]),
                Route("/teams/{team}/policies", self._wrap(self.policies), methods=["GET"]),
                Route(
                    "/teams/{team}/policies/{period}",
                    self._wrap(self.policy),
                    methods=["PUT", "DELETE"],
                ),
                Route(
                    "/teams/{team}/keys/{key}/policies/{period}",
                    self._wrap(self.policy),
                    methods=["PUT", "DELETE"],
                ),
                Route("/teams/{team}/usage", self._wrap(self.usage), methods=["GET"]),
                Route("/teams/{team}/keys/{key}/usage", self._wrap(self.usage), methods=["GET"]),
                Route("/teams/{team}/balance", self._wrap(self.balance), methods=["GET"]),
                Route("/teams/{team}/balance/topup", self._wrap(self.topup), methods=["POST"]),
                Route("/teams/{team}/balance/mode", self._wrap(self.balance_mode), methods=["PUT"]),
                Route("/teams/{team}/rates", self._wrap(self.rates), methods=["GET"]),
                Route(
                    "/teams/{team}/rates/team", self._wrap(self.rates), methods=["PUT", "DELETE"]
                ),
                Route(
                    "/teams/{team}/keys/{key}/rates",
                    self._wrap(self.rates),
                    methods=["PUT", "DELETE"],
                ),
                Route("/teams/{team}/models", self._wrap(self.models), methods=["GET"]),
                Route("/teams/{team}/models/{action}", self._wrap(self.models), methods=["POST"]),
                Route(
                    "/teams/{team}/keys/{key}/models/{action}",
                    self._wrap(self.models),
                    methods=["POST"],
                ),
                Route("/teams", self._wrap(self.teams), methods=["GET"]),
                Route("/top", self._wrap(self.top), methods=["GET"]),
                Route("/alerts", self._wrap(self.alerts), methods=["GET"]),
                Route("/alerts/test", self._wrap(self.alerts_test), methods=["POST"]),
                Route("/budgets", self._wrap(self.budgets_inspect), methods=["GET"]),
                Route("/budgets/reset", self._wrap(self.budgets_reset), methods=["POST"]),
                Route(
                    "/customers/{customer}/balance",
                    self._wrap(self.customer_balance),
                    methods=["GET"],
                ),
                Route(
                    "/customers/{customer}/balance/topup",
                    self._wrap(self.customer_topup),
                    methods=["POST"],
                ),
            ],
            exception_handlers={HTTPException: self._http_error},  # type: ignore[dict-item]
        )

    @property
    def routes(self) -> list[Any]:
        """The route table (for spendguard's own route checks and the doctor's)."""
        return list(self.router.routes)

    # -- the gate in front of every route --------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":  # mounted apps get none; a top-level one might
                await self.router(scope, receive, send)
            elif scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        request = Request(scope, receive)
        token = self._expected_token()
        if token is None:  # off: as if nothing were mounted here
            await _error(404, "not_found", "Not Found")(scope, receive, send)
            return
        route = _route_path(scope)
        if route in ("/page", "/page/login"):  # a person's: a cookie, not a header
            response = await self._page(request, route, token)
            await response(scope, receive, send)
            return
        given = request.headers.get("authorization")
        scheme, _, credentials = (given or "").partition(" ")
        if not given or scheme.lower() != "bearer" or not credentials.strip():
            await _error(
                401,
                "unauthorized",
                "send Authorization: Bearer <SPENDGUARD_ADMIN_TOKEN>",
                **{"WWW-Authenticate": 'Bearer realm="spendguard"'},
            )(scope, receive, send)
            return
        raw = _raw_header(scope, b"authorization")
        raw_credentials = raw.split(b" ", 1)[1].strip() if b" " in raw else b""
        if not hmac.compare_digest(raw_credentials, token.encode("utf-8")):
            await _error(403, "forbidden", "wrong admin token")(scope, receive, send)
            return
        raw_path: bytes = scope.get("raw_path") or b""
        if b"%2f" in raw_path.lower() or b"%5c" in raw_path.lower():
            # An encoded "/" would route an id's pieces as other segments (a team "x/keys/y").
            await _error(400, "invalid_id", "ids holding '/' or '\\' cannot be named in a path")(
                scope, receive, send
            )
            return
        await self.router(scope, receive, send)

    async def _page(self, request: Request, route: str, token: str) -> Response:
        root: str = request.scope.get("root_path") or ""
        if route == "/page/login":
            if request.method != "POST":
                return HTMLResponse(login_page(root), status_code=405)
            body = await _read_form(request)
            given = (parse_qs(body).get("token") or [""])[0]
            if not hmac.compare_digest(given.encode(), token.encode()):
                return HTMLResponse(login_page(root, wrong=True), status_code=403)
            response: Response = RedirectResponse(f"{root}/page", status_code=303)
            response.set_cookie(
                COOKIE,
                cookie_value(token),
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
                path=root or "/",
            )
            return response
        if request.method not in ("GET", "HEAD"):
            return HTMLResponse(login_page(root), status_code=405)
        if not cookie_matches(request.cookies.get(COOKIE), token):
            return HTMLResponse(login_page(root))
        target = self._find()
        if target is None or target.guard is None:
            return HTMLResponse("spendguard is not running here", status_code=503)
        try:
            admin = await self._admin(target)
            _, teams = await self.teams_with_limits(admin)
            reports = [await admin.usage(team) for team in teams[:_PAGE_TEAMS]]
            top = await admin.top_spenders("key", Period.DAY, 10)
            alerts = await admin.alerts(20)
            denials = await admin.recent_denials(20)
        except (SpendGuardError, TimeoutError, OSError) as exc:
            return HTMLResponse(
                f"spendguard: the ledger did not answer ({type(exc).__name__}); "
                "this page tries again in 30 s",
                status_code=503,
                headers={"refresh": "30"},
            )
        return HTMLResponse(spend_page(utcnow(), reports, top, alerts, denials))

    @staticmethod
    async def teams_with_limits(admin: Admin) -> tuple[TopReport, list[str]]:
        """Every team with a limit or spend this month, the biggest spenders first, and the
        month's report they were read from."""
        report = await admin.top_spenders("team", Period.MONTH, 1000)
        spent = [s.row.team_id for s in report.spenders]
        idle = sorted({p.team_id for p in await admin.list_policies()} - set(spent))
        return report, spent + idle

    def _expected_token(self) -> str | None:
        if self._token is not None:
            return self._token or None
        settings = self._settings()
        if settings is None or settings.admin_token is None:
            return None
        return settings.admin_token.get_secret_value() or None

    def _settings(self) -> Settings | None:
        if isinstance(self._source, SpendGuard):
            return self._source.settings
        target = self._find()
        return None if target is None else target.settings

    def _find(self) -> _Target | None:
        if self._target is not None:
            return self._target
        source = self._source
        if isinstance(source, SpendGuard):
            self._target = _Target(source.settings, source, self._budgets, None)
            return self._target
        middleware = _find_middleware(source)
        if middleware is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "spendguard admin routes: no SpendGuardMiddleware in %r (yet); pass "
                    "admin_app() the app the middleware was added to",
                    source,
                )
            return None
        self._target = _Target(
            middleware.settings,
            middleware.guard,
            self._budgets if self._budgets is not None else middleware.budgets,
            middleware.wiring,
        )
        return self._target

    def _wrap(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            target = self._find()
            if target is None:
                return _error(
                    503,
                    "not_ready",
                    "no SpendGuardMiddleware found in the app (yet): mount admin_app(app) "
                    "where app is the app the middleware was added to",
                )
            try:
                return await handler(request, target)
            except AdminError as exc:
                return _error(exc.status, exc.code, exc.message)
            except StoreUnavailable as exc:
                return _error(503, "store_unavailable", str(exc))
            except (LedgerUnavailable, TimeoutError, OSError) as exc:
                return _error(503, "ledger_unavailable", str(exc) or type(exc).__name__)
            except ValueError as exc:  # the admin API's own checks (a pattern, an account)
                return _error(400, "invalid_request", str(exc))
            except SpendGuardError as exc:
                return _error(503, "unavailable", str(exc))

        return endpoint

    @staticmethod
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        return _error(exc.status_code, code, str(exc.detail), **(exc.headers or {}))

    # -- routes ----------------------------------------------------------------------------
    @staticmethod
    async def _admin(target: _Target) -> Admin:
        if target.guard is None:
            raise AdminError(503, "disabled", "spendguard is disabled (SPENDGUARD_ENABLED=false)")
        # Without a lifespan the ledger connects on first use (as the first request would).
        await target.guard._ensure_connected()
        return target.guard.admin

    async def status(self, request: Request, target: _Target) -> Response:
        return JSONResponse(
            gateway_status(target.settings, target.guard, target.wiring, target.budgets)
        )

    async def config(self, request: Request, target: _Target) -> Response:
        return JSONResponse(effective_settings(target.settings))

    async def all_policies(self, request: Request, target: _Target) -> Response:
        admin = await self._admin(target)
        return JSONResponse(policies_json(await admin.list_policies()))

    async def policies(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        admin = await self._admin(target)
        rows = await admin.list_policies(identity.team_id)
        return JSONResponse(policies_json(rows, identity.team_id))

    async def policy(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        period = _period(request)
        if request.method == "DELETE":
            admin = await self._admin(target)
            removed = await admin.remove_policy(
                identity.team_id, identity.api_key_id, window=period
            )
            if not removed:
                raise AdminError(404, "not_found", "no such active policy")
            return JSONResponse(removed_json(True))
        body = await _body(request, {"limit_usd", "mode", "alert_at", "fit"}, {"limit_usd"})
        micros = _amount(body, "limit_usd", "a limit", allow_zero=True)
        hard = _mode(body, "soft")
        fit = body.get("fit", False)
        if not isinstance(fit, bool) or (fit and not hard):
            raise AdminError(400, "invalid_request", 'fit: true or false, true only with "hard"')
        admin = await self._admin(target)
        saved = await admin.set_policy(
            identity.team_id,
            identity.api_key_id,
            window=period,
            limit_usd=micros_to_usd(micros),
            hard=hard,
            alert_at=_alert_at(body),
            fit=fit,
        )
        return JSONResponse(policy_json(saved))

    async def top(self, request: Request, target: _Target) -> Response:
        q = request.query_params
        by, period, raw = q.get("by", "team"), q.get("period", "day"), q.get("limit", "10")
        if by not in TOP_BY:
            raise AdminError(400, "invalid_request", f"by: {', '.join(TOP_BY)}")
        if period not in ("day", "month"):
            raise AdminError(400, "invalid_request", "period: day or month")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            raise AdminError(400, "invalid_request", "limit: 1 to 1000")
        admin = await self._admin(target)
        return JSONResponse(top_json(await admin.top_spenders(by, Period(period), int(raw))))

    async def teams(self, request: Request, target: _Target) -> Response:
        """Every team with a limit or spend this month, biggest spender first (then the
        teams with limits and no spend yet, by id)."""
        admin = await self._admin(target)
        report, teams = await self.teams_with_limits(admin)
        spent = {s.row.team_id: s.row.spent for s in report.spenders}
        rows = [{"team": team, "spent_month_micros": spent.get(team, 0)} for team in teams]
        return JSONResponse({"month": report.period_id, "teams": rows})

    async def alerts(self, request: Request, target: _Target) -> Response:
        raw = request.query_params.get("limit", "50")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            raise AdminError(400, "invalid_request", "limit: 1 to 1000")
        admin = await self._admin(target)
        return JSONResponse(alerts_json(await admin.alerts(int(raw))))

    async def alerts_test(self, request: Request, target: _Target) -> Response:
        await self._admin(target)
        assert target.guard is not None
        try:
            alert, error = await target.guard.alerts.send_sample()
        except ConfigurationError as exc:
            raise AdminError(404, "no_webhook", str(exc)) from None
        return JSONResponse(
            alert_test_json(alert, error), status_code=200 if error is None else 502
        )

    async def usage(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        admin = await self._admin(target)
        report = await admin.usage(identity.team_id, identity.api_key_id)
        return JSONResponse(usage_json(report, identity.api_key_id))

    async def balance(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        admin = await self._admin(target)
        report = await admin.balance(identity.team_id)
        if report is None:
            raise AdminError(404, "no_account", "no balance account (the team is not prepaid)")
        return JSONResponse(balance_report_json(report))

    async def topup(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        body = await _body(request, {"usd"}, {"usd"})
        micros = _amount(body, "usd", "a top-up", allow_zero=False)
        admin = await self._admin(target)
        account = await admin.topup(identity.team_id, micros_to_usd(micros))
        return JSONResponse(balance_json(identity.team_id, account))

    async def balance_mode(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        body = await _body(request, {"mode"}, {"mode"})
        hard = _mode(body)
        admin = await self._admin(target)
        try:
            account = await admin.set_balance_mode(identity.team_id, hard=hard)
        except ValueError as exc:
            raise AdminError(404, "no_account", str(exc)) from None
        return JSONResponse(balance_json(identity.team_id, account))

    async def models(self, request: Request, target: _Target) -> Response:
        identity = _identity(request)
        if request.method == "GET":
            admin = await self._admin(target)
            return JSONResponse(
                model_lists_json(identity.team_id, await admin.list_models(identity.team_id))
            )
        action = request.path_params["action"]
        if action not in ("allow", "remove"):
            raise AdminError(404, "not_found", "models/allow or models/remove")
        body = await _body(request, {"models"}, {"models"})
        models = body["models"]
        if (
            not isinstance(models, list)
            or not models
            or not all(isinstance(m, str) for m in models)
        ):
            raise AdminError(400, "invalid_request", "models: a non-empty list of strings")
        admin = await self._admin(target)
        lists = await admin.allow_models(
            identity.team_id, identity.api_key_id, models, allowed=action == "allow"
        )
        return JSONResponse(model_lists_json(identity.team_id, lists))

    async def rates(self, request: Request, target: _Target) -> Response:
        """GET: the team's rates; PUT: set a key's (or the team's) rates, a rate not given
        keeps its value and 0 removes it; DELETE: remove them all."""
        identity = _identity(request)
        admin = await self._admin(target)
        if request.method == "PUT":
            body = await _body(request, set(RATE_FIELDS), set())
            if not body:
                raise AdminError(400, "invalid_request", "give rpm, tpm or max_parallel")
            for name, value in body.items():
                if isinstance(value, bool) or not isinstance(value, int):
                    raise AdminError(400, "invalid_request", f"{name}: a whole number (0 removes)")
            try:
                await admin.set_rates(identity.team_id, identity.api_key_id, **body)
            except ValueError as exc:
                raise AdminError(400, "invalid_request", str(exc)) from None
        elif request.method == "DELETE" and not await admin.remove_rates(
            identity.team_id, identity.api_key_id
        ):
            raise AdminError(404, "not_found", "no rates to remove")
        return JSONResponse(rates_json(identity.team_id, await admin.list_rates(identity.team_id)))

    @staticmethod
    def _budget_admin(target: _Target) -> BudgetAdmin:
        if target.guard is None:
            raise AdminError(503, "disabled", "spendguard is disabled (SPENDGUARD_ENABLED=false)")
        if target.budgets is None:
            raise AdminError(404, "no_budgets", "no budgets are configured")
        return BudgetAdmin.of(target.budgets, target.guard.ledger)

    async def budgets_inspect(self, request: Request, target: _Target) -> Response:
        budgets = self._budget_admin(target)
        return JSONResponse(budget_report_json(await budgets.inspect()))

    async def budgets_reset(self, request: Request, target: _Target) -> Response:
        budgets = self._budget_admin(target)
        fields = {
            "scope",
            "window",
            "team_id",
            "api_key_id",
            "model",
            "end_user",
            "tag",
            "customer",
        }
        body = await _body(request, fields, {"scope"})
        for name, value in body.items():
            if (value is not None or name == "scope") and not isinstance(value, str):
                raise AdminError(400, "invalid_request", f"{name}: a string")
        for name in ("team_id", "api_key_id"):
            value = body.get(name)
            if isinstance(value, str) and (len(value) > MAX_PATH_ID or not value.isprintable()):
                raise AdminError(
                    400, "invalid_id", f"{name}: at most {MAX_PATH_ID} printable characters"
                )
        n = await budgets.reset(
            body["scope"],
            window=body.get("window"),
            team_id=body.get("team_id"),
            api_key_id=body.get("api_key_id"),
            model=body.get("model"),
            end_user=body.get("end_user"),
            tag=body.get("tag"),
            customer=body.get("customer"),
        )
        return JSONResponse(budget_reset_json(n))

    async def customer_balance(self, request: Request, target: _Target) -> Response:
        budgets = self._budget_admin(target)
        found = await budgets.customer_balance(_customer_of(request))
        if found is None:
            raise AdminError(404, "no_account", "no prepaid account (the customer is not prepaid)")
        return JSONResponse(found.as_json())

    async def customer_topup(self, request: Request, target: _Target) -> Response:
        budgets = self._budget_admin(target)
        body = await _body(request, {"usd"}, {"usd"})
        micros = _amount(body, "usd", "a top-up", allow_zero=False)
        account = await budgets.topup_customer(_customer_of(request), micros_to_usd(micros))
        return JSONResponse(account.as_json())


def _customer_of(request: Request) -> str:
    customer = str(request.path_params["customer"])
    if len(customer) > MAX_PATH_ID or not customer.isprintable():
        raise AdminError(400, "invalid_id", f"customer: at most {MAX_PATH_ID} printable characters")
    return customer


def _raw_header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return b""


def _version() -> str | None:
    try:
        return version("spendguard")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return None


LIFESPAN_STATES = {
    "lifespan": "lifespan",
    "first request": "first_request",
    "the host app": "host_app",
}


def gateway_status(
    settings: Settings, guard: SpendGuard | None, wiring: Any, budgets: BudgetGate | None
) -> dict[str, Any]:
    """What ``GET /status`` answers: how the background tasks were started and whether they
    run, the store and the ledger in use (``spendguard doctor --gateway`` reads it)."""
    redis = settings.redis_url
    store_url = None if redis is None else redact_url(redis.get_secret_value())
    if redis is None:
        mode = "embedded"
    elif redis.get_secret_value().startswith("redis+cluster"):
        mode = "redis_cluster"
    else:
        mode = "redis"
    wired: dict[str, Any] = {} if wiring is None else dict(wiring.status())
    started_by = wired.get("background_started_by")
    running = guard is not None and guard.running
    if started_by is not None:
        state = LIFESPAN_STATES.get(str(started_by), str(started_by))
    else:
        state = "host_app" if running else "not_started"
    data: dict[str, Any] = {
        "version": _version(),
        "enabled": guard is not None,
        "lifespan": state,
        "running": running,
        "record_writer": None,
        "worker": None,
        "store": {"mode": mode, "url": store_url, "shared": redis is not None},
        "ledger": {"url": redact_url(settings.database_url.get_secret_value()), "connected": False},
        "budgets": budgets is not None,
        "routes": {
            "configured": list(settings.routes),
            "checked": wired.get("checked"),
            "deferred": wired.get("deferred_routes", []),
        },
    }
    if guard is not None:
        recorder = guard.recorder
        data["record_writer"] = {
            "running": recorder.running,
            "pending": recorder.pending,
            "dropped": recorder.dropped,
            "capacity": recorder.capacity,
        }
        data["worker"] = {
            "running": guard.worker.running,
            "settling": guard.worker.settling,
            "interval_seconds": settings.settle_interval,
        }
        data["store"]["shared"] = guard.store.shared
        data["ledger"]["connected"] = guard.ledger.connected
    return data


def admin_app(
    source: object, *, token: str | None = None, budgets: BudgetGate | None = None
) -> AdminApp:
    """The admin routes of the gateway ``source`` is (see the module docstring).

    ``token``: the bearer token (default: ``SPENDGUARD_ADMIN_TOKEN`` of the middleware's
    settings; unset or empty: every route answers 404)."""
    return AdminApp(source, token=token, budgets=budgets)


__all__ = ["AdminApp", "admin_app", "gateway_status", "policy_json", "usage_json"]
