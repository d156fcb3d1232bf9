"""Tests for spendguard.settings: SPENDGUARD_* variables, validated at load, errors naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from spendguard.errors import ConfigurationError
from spendguard.settings import Settings, load_settings


@pytest.mark.parametrize(
    ("env", "value", "field"),
    [
        ("SPENDGUARD_SETTLE_INTERVAL", "-1", "SPENDGUARD_SETTLE_INTERVAL"),
        ("SPENDGUARD_KEY_PREFIX", "a{b}", "SPENDGUARD_KEY_PREFIX"),
        ("SPENDGUARD_DATABASE_URL", "mysql://x", "SPENDGUARD_DATABASE_URL"),
        ("SPENDGUARD_ROUTES", "v1/chat", "SPENDGUARD_ROUTES"),
        ("SPENDGUARD_REDIS_URL", "http://127.0.0.1:6379", "SPENDGUARD_REDIS_URL"),
        ("SPENDGUARD_PRICES", "/nonexistent/prices.json", "SPENDGUARD_PRICES"),
        ("SPENDGUARD_UNKNOWN_MODEL", "guess", "SPENDGUARD_UNKNOWN_MODEL"),
        ("SPENDGUARD_DEFAULT_OUTPUT_TOKENS", "0", "SPENDGUARD_DEFAULT_OUTPUT_TOKENS"),
        (
            "SPENDGUARD_DEFAULT_OUTPUT_TOKENS_BY_MODEL",
            '{"gpt-4o": 0}',
            "SPENDGUARD_DEFAULT_OUTPUT_TOKENS_BY_MODEL",
        ),
    ],
)
def test_invalid_settings_fail_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigurationError, match=field):
        load_settings()


def test_unknown_setting_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPENDGUARD_SETTLE_INTERVALL", "3")
    load_settings()
    assert "SPENDGUARD_SETTLE_INTERVALL" in caplog.text


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPENDGUARD_ROUTES", "/v1/chat/completions/, /custom/infer")
    monkeypatch.setenv("SPENDGUARD_ENABLED", "false")
    s = load_settings()
    assert s.routes == ("/v1/chat/completions", "/custom/infer") and not s.enabled


def test_the_default_output_reservation_per_model_is_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPENDGUARD_DEFAULT_OUTPUT_TOKENS", "2048")
    monkeypatch.setenv("SPENDGUARD_DEFAULT_OUTPUT_TOKENS_BY_MODEL", '{" GPT-4o-mini ": 1024}')
    settings = load_settings()
    assert settings.default_output_tokens == 2048
    assert settings.default_output_tokens_by_model == {"gpt-4o-mini": 1024}


def test_bad_redis_url_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPENDGUARD_REDIS_URL", "memcached://localhost")
    with pytest.raises(ConfigurationError, match="SPENDGUARD_REDIS_URL"):
        load_settings()


@pytest.mark.parametrize(
    ("given", "relative"),
    [
        ("sqlite:///./spendguard.db", "spendguard.db"),
        ("sqlite:///data/ledger.db?timeout=3", "data/ledger.db?timeout=3"),
        ("sqlite+aiosqlite:///l.db", "l.db"),
    ],
)
def test_a_relative_sqlite_path_is_made_absolute_once(
    given: str, relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings(database_url=given)
    scheme = given.split(":", 1)[0]
    expected = f"{scheme}:///{tmp_path}/{relative}"
    assert settings.database_url.get_secret_value() == expected
    monkeypatch.chdir("/")  # resolved when the settings were read, not at each use
    assert settings.database_url.get_secret_value() == expected


@pytest.mark.parametrize(
    "url", ["sqlite:////var/lib/ledger.db", "sqlite:///:memory:", "postgresql://u:p@h/db"]
)
def test_other_database_urls_are_kept(url: str) -> None:
    assert Settings(database_url=url).database_url.get_secret_value() == url


def test_the_default_database_is_in_the_working_directory_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPENDGUARD_DATABASE_URL", raising=False)
    assert Settings().database_url.get_secret_value() == f"sqlite:///{tmp_path}/spendguard.db"
