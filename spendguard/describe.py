"""Where spendguard's state lives, in one line each, with secrets redacted: for the start-up
log, the CLI and ``spendguard doctor``."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .settings import Settings

_SECRET_PARAMS = frozenset({"password", "passwd", "pass", "sslpassword", "token"})


def redact_url(url: str) -> str:
    """The URL with its password (if any, in the netloc or as a ``password=`` query
    parameter) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.query:
        query = "&".join(
            f"{name}=***" if name.lower() in _SECRET_PARAMS and sep else f"{name}{sep}{value}"
            for name, sep, value in (p.partition("=") for p in parts.query.split("&"))
        )
        parts = parts._replace(query=query)
        url = urlunsplit(parts)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def sqlite_file(settings: Settings) -> Path | None:
    """The SQLite ledger's file (absolute: settings resolve it), or None."""
    url = settings.database_url.get_secret_value()
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.startswith("sqlite"):
        return None
    path = rest.partition("?")[0]
    return None if path in ("", ":memory:") else Path(path)


def ledger_description(settings: Settings) -> str:
    path = sqlite_file(settings)
    if path is not None:
        return f"SQLite file {path}" + ("" if path.exists() else " (new: it does not exist yet)")
    return redact_url(settings.database_url.get_secret_value())


def store_description(settings: Settings) -> str:
    if settings.redis_url is None:
        return "embedded (inside each gateway process)"
    return redact_url(settings.redis_url.get_secret_value())


def default_database(settings: Settings) -> bool:
    """True when the ledger is the default ``./spendguard.db`` of the working directory."""
    return "database_url" not in settings.model_fields_set
