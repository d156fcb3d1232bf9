"""Settings, read from ``SPENDGUARD_*`` environment variables.

Invalid values fail when the middleware, worker or CLI starts, with a message naming the field.
"""

from __future__ import annotations

import logging
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .errors import ConfigurationError

log = logging.getLogger("spendguard")


def _default_routes() -> tuple[str, ...]:
    """The OpenAI-, Azure- and Anthropic-compatible inference paths popular gateways serve."""
    endpoints: tuple[str, ...] = ("/chat/completions", "/completions", "/responses")
    endpoints += ("/responses/compact", "/embeddings", "/messages")
    prefixes = ("/v1", "", "/openai/v1", "/openai")
    routes = [f"{prefix}{path}" for prefix in prefixes for path in endpoints]
    routes += ["/anthropic/v1/messages", "/anthropic/messages"]
    # The model is the path's: Azure's deployments and the legacy engines.
    bases = ("/openai/deployments", "/deployments", "/engines", "/v1/engines", "/openai/engines")
    for base in bases:
        for path in ("/chat/completions", "/completions", "/embeddings", "/responses"):
            routes.append(f"{base}/{{model:path}}{path}")
    # Any other prefix of the one unmistakable inference path (a gateway's queue, an editor's
    # proxy route): after the patterns above, so they name the model first.
    routes.append("/{prefix:path}/chat/completions")
    # And of the versioned paths (a coding tool's `/claude_code_gateway/v1/messages`).
    routes += [f"/{{prefix:path}}/v1{path}" for path in ("/messages", "/responses", "/embeddings")]
    return tuple(routes)


DEFAULT_ROUTES = _default_routes()
# POST routes whose bodies look like inferences but call no paid model: token counters.
DEFAULT_PASS_ROUTES = (
    "/utils/token_counter",
    "/v1/messages/count_tokens",
    "/messages/count_tokens",
    "/anthropic/v1/messages/count_tokens",
    "/v1/responses/input_tokens",
    "/responses/input_tokens",
    "/openai/v1/responses/input_tokens",
)


class AlertFormat(StrEnum):
    JSON = "json"
    SLACK = "slack"


class Unlisted(StrEnum):
    """A POST that looks like an inference (a model and a prompt) on a route nobody listed."""

    REFUSE = "refuse"  # 403 before the app is called
    WARN = "warn"  # passed to the app; a WARNING once per route and a metric


class FailMode(StrEnum):
    OPEN = "open"  # allow, counted in a bounded local tracker
    CLOSED = "closed"  # 503 with Retry-After


class UnknownModel(StrEnum):
    DEFAULT_PRICE = "default_price"  # charge the price table's "default" entry
    FREE = "free"  # record tokens, charge 0
    REJECT = "reject"  # 400 before the provider is called


class MissingIdentity(StrEnum):
    REJECT = "reject"  # 401
    ALLOW = "allow"  # pass through, unlimited and unrecorded


def _checked_routes(value: tuple[str, ...], defaults: tuple[str, ...]) -> tuple[str, ...]:
    """Routes as configured, ``default`` expanded, each an absolute path or pattern."""
    from .asgi.routes import route_pattern  # (the routes import these settings' module)

    routes: list[str] = []
    for path in value:
        if path == "default":
            routes.extend(defaults)
            continue
        if not path.startswith("/") or any(c.isspace() for c in path):
            raise ValueError(f"{path!r} is not an absolute path")
        route_pattern(path)  # path parameters: /openai/deployments/{deployment}/...
        routes.append(path.rstrip("/") or "/")
    return tuple(dict.fromkeys(routes))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPENDGUARD_", extra="forbid", frozen=True)

    enabled: bool = Field(True, description="False makes the middleware a strict no-op.")
    database_url: SecretStr = Field(
        SecretStr("sqlite:///./spendguard.db"),
        description="SQL ledger URL: sqlite:///path or postgresql://user@host/db. A relative "
        "SQLite path is made absolute against the working directory when settings are read.",
    )
    redis_url: SecretStr | None = Field(
        None,
        description="Redis URL (redis://, rediss://, redis+cluster://); unset: embedded store.",
    )
    redis_timeout: float = Field(
        0.25,
        gt=0,
        le=30,
        description="Seconds one Redis round trip may take (a batch of concurrent hot-path "
        "calls, or one other call), connecting included.",
    )
    owner_ttl: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="With Redis: seconds after its last heartbeat that a gateway counts as "
        "dead, and a settling worker writes the records of the inferences it left.",
    )
    rate_slot_ttl: float = Field(
        600.0,
        ge=1,
        le=86_400,
        description="Seconds an admitted request counts against a max-parallel rate (and keeps "
        "its TPM reservation open) at most: the bound after which a slot left by a gateway "
        "that died is freed.",
    )
    fail_mode: FailMode = Field(
        FailMode.CLOSED, description="Redis unavailable: closed (503) or open (allow, tracked)."
    )
    fail_open_max_keys: int = Field(
        10_000, ge=1, description="Identities the fail-open tracker holds (full: 503)."
    )
    key_prefix: str = Field("quota", description="Prefix of every cache key.")
    routes: Annotated[tuple[str, ...], NoDecode] = Field(
        DEFAULT_ROUTES,
        description="Inference routes (comma-separated paths, POST only; path parameters "
        "allowed: /openai/deployments/{deployment}/chat/completions).",
    )
    pass_routes: Annotated[tuple[str, ...], NoDecode] = Field(
        DEFAULT_PASS_ROUTES,
        description="POST routes that pass untouched although their bodies look like "
        "inferences (comma-separated, as routes; 'default' stands for the built-in token "
        "counters; an empty value lists none).",
    )
    end_user_from: Annotated[tuple[str, ...], NoDecode] = Field(
        ("state",),
        description="Where a request's end user comes from, tried in order (comma-separated): "
        "state (the app's request.state.spendguard_end_user), header:<name> (a header the "
        "gateway's own auth sets), body (the client's user or safety_identifier: untrusted) or "
        "body:<field> (one body field, dotted: metadata.end_user).",
    )
    tags_from: Annotated[tuple[str, ...], NoDecode] = Field(
        ("state",),
        description="Where a request's tags come from, tried in order (comma-separated): state "
        "(the app's request.state.spendguard_tags, a list), header:<name> (comma-separated "
        "values of a header the gateway's own auth sets) or body:<field> (a list in one body "
        "field, dotted: metadata.tags).",
    )
    customer_from: Annotated[tuple[str, ...], NoDecode] = Field(
        ("state",),
        description="Where a request's customer (the organisation above its team) comes from, "
        "tried in order (comma-separated): state (the app's request.state.spendguard_customer), "
        "header:<name> (a header the gateway's own auth sets) or body:<field> (one body "
        "field, dotted).",
    )
    unlisted_inference: Unlisted = Field(
        Unlisted.REFUSE,
        description="A POST whose JSON body looks like an inference on a route in neither "
        "list: refuse (403) or warn (passed, logged once per route, counted).",
    )
    prices: Path | None = Field(
        None,
        description="Price file laid over the shipped table: spendguard's format (JSON or YAML), "
        "LiteLLM's JSON, or 'litellm' for the installed litellm package's file.",
    )
    unknown_model: UnknownModel = Field(
        UnknownModel.DEFAULT_PRICE, description="What a model missing from the price table costs."
    )
    default_output_tokens: int = Field(
        4096,
        ge=1,
        le=10_000_000,
        description="Output tokens a hard limit, a TPM rate and a token budget reserve for a "
        "request that sets no max_tokens (or max_completion_tokens, max_output_tokens), capped "
        "at the model's maximum output where the price table knows it.",
    )
    default_output_tokens_by_model: dict[str, int] = Field(
        default_factory=dict,
        description='The same per model, as JSON: {"gpt-4o-mini": 1024}; a name as clients '
        "send it or as its price-table entry, case-insensitive.",
    )
    provider_candidates: dict[str, list[str]] = Field(
        default_factory=dict,
        description="The provider keys (pool ids) an inference of a model may use, in "
        'order, as JSON: {"gpt-4o*": ["openai-1", "openai-2"]}; the first glob that matches '
        "the request's model decides. One is leased in the admission round and settled in "
        "the finishing one; the app finds it in request.state.spendguard_provider_key.",
    )
    provider_keys: list[dict[str, str | int | None]] = Field(
        default_factory=list,
        description="Provider keys registered in the pool at start (every replica; counters "
        'and cooldowns are kept), as JSON: [{"id": "openai-1", "provider": "openai", '
        '"tpm": 2000000, "rpm": 5000}]; tpm/rpm absent or null: unlimited. Ids, never secrets.',
    )
    remaining_headers: bool = Field(
        False,
        description="Tell callers their API key's remaining daily/monthly spend limits in "
        "x-spendguard-remaining-usd-* headers (with -limit-usd-* and -reset-*).",
    )
    fit_min_output_tokens: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Fit instead of refuse: a request a hard spend limit would refuse goes on "
        "with its max_tokens lowered to what fits, if that is at least this many tokens "
        "(unset: refuse as sent).",
    )
    fit_by_default: bool = Field(
        True,
        description="With SPENDGUARD_FIT_MIN_OUTPUT_TOKENS: every hard limit and budget fits "
        "(true), or only those that opt in (false: `policy set --fit`, a budget's `fit: true`).",
    )
    ratelimit_headers: bool = Field(
        False,
        description="Tell callers their API key's spend limits, RPM, TPM and parallel cap in "
        "the IETF RateLimit-Policy and RateLimit fields (draft-ietf-httpapi-ratelimit-headers).",
    )
    settle_interval: float = Field(5.0, gt=0, le=3600, description="Seconds between settlements.")
    settle_batch: int = Field(1000, ge=1, le=100_000, description="Records per settlement batch.")
    run_worker: bool = Field(
        True, description="Settle inside the app (the cache is kept in sync either way)."
    )
    policy_ttl: float = Field(60.0, gt=0, le=86_400, description="Seconds a cached policy lives.")
    policy_stale_max: float = Field(
        3600.0,
        ge=0,
        le=7 * 86_400,
        description=(
            "While the ledger can't be read, seconds after its last read that a team's policy "
            "keeps being enforced from memory (0: a 503 once the cached policy expires)."
        ),
    )
    key_grace: float = Field(
        172_800.0,
        ge=3600,
        description="Seconds a usage key outlives its period (settlement grace).",
    )
    missing_identity: MissingIdentity = Field(
        MissingIdentity.REJECT, description="Inference request without identity: reject or allow."
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest inference request body read (413 above)."
    )
    memory_max_keys: int = Field(100_000, ge=1, description="Bound of the embedded store.")
    record_buffer: int = Field(
        100_000, ge=1, description="Records held in memory while the database is unreachable."
    )
    db_timeout: float = Field(
        5.0, gt=0, description="Seconds a ledger read on a cache miss may take."
    )
    otel: bool = Field(
        False,
        description="An OpenTelemetry span around every preflight and postflight (needs the "
        "otel extra; spans go to the tracer provider the app configured).",
    )
    budgets_file: Path | None = Field(
        None,
        description="Budgets file (JSON or YAML): token and USD quotas over rolling windows; "
        "polled for edits about once a second.",
    )
    budgets: dict[str, Any] | None = Field(
        None, description="The budgets section itself (used when no budgets_file is set)."
    )
    budget_stock: int = Field(
        64,
        ge=0,
        le=256,
        description="The most holds a gateway keeps stocked per model in the model's and the "
        "fleet's budget buckets on Redis, so that a request needs no script there on its way "
        "in: 8 at first, then as many as its requests came for between two refills (0: off).",
    )
    budget_stock_share: int = Field(
        4,
        ge=1,
        le=1_000_000,
        description="A shared budget bucket grants stock only while what stays free is at "
        "least this many times the stock: near a limit every request is decided centrally.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token of the admin HTTP routes (spendguard.asgi.admin_app); "
        "unset or empty: those routes answer 404.",
    )
    alert_thresholds: Annotated[tuple[int, ...], NoDecode] = Field(
        (),
        description="Percentages of every spend limit (team and API key, day and month) that "
        "alert once per window when usage reaches them, e.g. 50,80,100; empty: no alerts.",
    )
    alert_projected: bool = Field(
        False,
        description="Also alert, once per limit and window, when a spend limit is projected "
        "to run out before it resets at its recent spend rate (checked every "
        "alert_forecast_interval seconds for the teams charged meanwhile).",
    )
    alert_forecast_interval: float = Field(
        60.0, gt=0, le=86_400, description="Seconds between projected-alert checks."
    )
    alert_webhook_url: str | None = Field(
        None,
        description="Where alerts are POSTed (JSON, signed when a secret is set); unset: "
        "alerts are only logged and counted.",
    )
    alert_webhook_secret: SecretStr | None = Field(
        None,
        description="HMAC-SHA256 key of the alerts' spendguard-signature header.",
    )
    alert_webhook_format: AlertFormat = Field(
        AlertFormat.JSON,
        description="json (the alert itself) or slack (a Slack-compatible message).",
    )
    alert_interval: float = Field(
        1.0, gt=0, le=3600, description="Seconds between alert delivery passes."
    )

    @field_validator("alert_thresholds", mode="before")
    @classmethod
    def _parse_thresholds(cls, value: object) -> object:
        from .alerts.thresholds import parse_thresholds

        if isinstance(value, str | list | tuple):
            return parse_thresholds(value)
        return value

    @field_validator("alert_webhook_url")
    @classmethod
    def _check_webhook(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL")
        return value or None

    @field_validator("end_user_from", "tags_from", "customer_from", mode="before")
    @classmethod
    def _split_sources(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("end_user_from", "tags_from", "customer_from")
    @classmethod
    def _check_sources(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        allowed = ("state", "body") if info.field_name == "end_user_from" else ("state",)
        for source in value:
            kind, _, name = source.partition(":")
            field = kind == "body" and name != "" and all(p.strip() for p in name.split("."))
            if source in allowed or (kind == "header" and name.strip()) or field:
                continue
            raise ValueError(
                f"{source!r}: one of {', '.join(allowed)}, header:<name> or body:<field>"
            )
        return tuple(s.lower() if s.startswith("header:") else s for s in value)

    @field_validator("routes", "pass_routes", mode="before")
    @classmethod
    def _split_routes(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one route")
        return _checked_routes(value, DEFAULT_ROUTES)

    @field_validator("pass_routes")
    @classmethod
    def _check_pass_routes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _checked_routes(value, DEFAULT_PASS_ROUTES)

    @field_validator("default_output_tokens_by_model")
    @classmethod
    def _check_output_by_model(cls, value: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, tokens in value.items():
            if not name.strip():
                raise ValueError("empty model name")
            if not 1 <= tokens <= 10_000_000:
                raise ValueError(f"{name!r}: output tokens must be 1..10000000, got {tokens}")
            out[name.strip().lower()] = tokens
        return out

    @field_validator("provider_candidates")
    @classmethod
    def _check_candidates(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for glob, ids in value.items():
            if not glob.strip():
                raise ValueError("empty model glob")
            if not ids or not all(isinstance(i, str) and i for i in ids):
                raise ValueError(f"{glob!r}: give a non-empty list of provider key ids")
        return value

    @field_validator("provider_keys")
    @classmethod
    def _check_provider_keys(
        cls, value: list[dict[str, str | int | None]]
    ) -> list[dict[str, str | int | None]]:
        seen: set[str] = set()
        for i, key in enumerate(value):
            if set(key) - {"id", "provider", "tpm", "rpm"}:
                raise ValueError(f"key {i}: fields are id, provider, tpm, rpm")
            for name in ("id", "provider"):
                if not isinstance(key.get(name), str) or not key[name]:
                    raise ValueError(f"key {i}: {name!r} must be a non-empty string")
            for name in ("tpm", "rpm"):
                n = key.get(name)
                if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
                    raise ValueError(f"key {i}: {name!r} must be a whole number >= 0, or null")
            if key["id"] in seen:
                raise ValueError(f"key {i}: id {key['id']!r} listed twice")
            seen.add(str(key["id"]))
        return value

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", value):
            raise ValueError("use 1-64 characters of A-Z a-z 0-9 _ . - (no braces or colons)")
        return value

    @field_validator("database_url")
    @classmethod
    def _check_db(cls, value: SecretStr) -> SecretStr:
        scheme = value.get_secret_value().split(":", 1)[0]
        if scheme.split("+", 1)[0] not in {"sqlite", "postgresql", "postgres"}:
            raise ValueError("use sqlite:///path or postgresql://user@host/db")
        return SecretStr(absolute_sqlite_url(value.get_secret_value()))

    @field_validator("prices")
    @classmethod
    def _check_prices(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"price file {value} does not exist")
        return value

    @field_validator("budgets_file")
    @classmethod
    def _check_budgets_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            from .budgets.config import BudgetConfigError, read_budgets

            try:
                read_budgets(value)
            except BudgetConfigError as exc:
                raise ValueError("; ".join(exc.problems)) from None
        return value

    @field_validator("budgets")
    @classmethod
    def _check_budgets(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from .budgets.config import BudgetConfigError, parse_budgets

            try:
                parse_budgets(value)
            except BudgetConfigError as exc:
                raise ValueError("; ".join(exc.problems)) from None
        return value

    @field_validator("admin_token")
    @classmethod
    def _check_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None  # empty: the admin routes stay off
        token = value.get_secret_value()
        if any(not c.isprintable() or c.isspace() for c in token):
            raise ValueError("no whitespace or control characters in the admin token")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            # The store registry is the one list of schemes (imported here, not at the top:
            # the stores themselves read these settings).
            from .store import STORES

            scheme = value.get_secret_value().split("://", 1)[0]
            if scheme not in STORES or scheme == "memory":
                raise ValueError("use redis://, rediss://, unix:// or redis+cluster://host:port")
        return value


def absolute_sqlite_url(url: str) -> str:
    """A SQLite URL with a relative path, made absolute against the working directory now.

    Resolved once, when the settings are read: the gateway and the CLI then name the file they
    use, instead of each opening whatever ``./spendguard.db`` is where it happens to run.
    """
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.startswith("sqlite"):
        return url
    path, query_sep, query = rest.partition("?")
    if not path or path == ":memory:" or path.startswith("/"):
        return url
    return f"{scheme}:///{Path(path).absolute()}{query_sep}{query}"


def load_settings(**overrides: object) -> Settings:
    """Build Settings from the environment (plus overrides), as a ConfigurationError on failure.

    An unknown ``SPENDGUARD_*`` variable is most likely a typo of a real setting: it is logged
    as a warning (not an error: other tools may share the prefix).
    """
    known = {f"SPENDGUARD_{name.upper()}" for name in Settings.model_fields}
    for name in sorted(os.environ):
        if name.upper().startswith("SPENDGUARD_") and name.upper() not in known:
            log.warning("unknown setting %s ignored (known: %s)", name, ", ".join(sorted(known)))
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(
            f"SPENDGUARD_{'.'.join(str(p) for p in err['loc']).upper() or 'SETTINGS'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigurationError(f"invalid spendguard settings: {problems}") from exc
