"""The budgets section: periods, validation naming each field, the validate command (exit 2),
settings that refuse an invalid section at start, and the polled file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spendguard.budgets import BudgetConfigError, BudgetsSource, parse_budgets, parse_period
from spendguard.budgets.config import DISABLED, Storage
from spendguard.cli import main
from spendguard.errors import ConfigurationError
from spendguard.limits.model import BudgetLimit
from spendguard.limits.windows import Period
from spendguard.settings import load_settings

SEED_EXAMPLE = """
budgets:
  enabled: true
  storage: memory            # memory | redis
  fail_open: true
  windows:
    - id: daily
      period: 24h
    - id: monthly
      period: 30d
  scopes:
    per_api_key:
      tokens: 2000000
      cost_usd: 50.0
    per_model:
      gpt-5.6-sol:
        tokens: 500000
    global:
      tokens: 20000000
      cost_usd: 500.0
  cost_source: model_metadata
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1m", 60),
        ("90m", 5400),
        ("24h", 86_400),
        ("30d", 2_592_000),
        ("2w", 1_209_600),
        ("calendar:day", 86_400),  # an alias of 24h, not a midnight reset
        ("calendar:month", 2_592_000),  # an alias of 30d, not a 1st-of-month reset
    ],
)
def test_periods(text: str, seconds: int) -> None:
    assert parse_period(text) == seconds


@pytest.mark.parametrize("text", ["", "0h", "1s", "h", "1.5h", "calendar:week", "24 h", "-1d"])
def test_unparsable_periods(text: str) -> None:
    with pytest.raises(ValueError):
        parse_period(text)


def test_the_seed_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "budgets.yaml"
    path.write_text(SEED_EXAMPLE)
    source = BudgetsSource.from_file(path)
    config = source.current()
    assert config.active and config.storage is Storage.MEMORY and config.fail_open
    assert [(w.id, w.seconds) for w in config.windows] == [
        ("daily", 86_400),
        ("monthly", 2_592_000),
    ]
    assert config.per_api_key is not None and config.per_api_key.cost_micros == 50_000_000
    assert config.per_model["gpt-5.6-sol"].tokens == 500_000
    assert config.global_ is not None and config.global_.tokens == 20_000_000


def test_absent_or_disabled_is_off() -> None:
    assert parse_budgets(None) is DISABLED
    assert parse_budgets({"budgets": None}) is DISABLED
    assert not parse_budgets({"enabled": False, "scopes": {"global": {"tokens": 5}}}).active


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        (
            {"windows": [{"id": "d", "period": "1h"}, {"id": "d", "period": "2h"}]},
            "budgets.windows[1].id: duplicate window id 'd'",
        ),
        ({"windows": [{"id": "d", "period": "1y"}]}, "budgets.windows[0].period: '1y'"),
        (
            {"enabled": True, "scopes": {"global": {"tokens": 5}}},
            "budgets.windows: the section is enabled and has limits but no windows",
        ),
        ({"scopes": {"global": {"tokens": 0}}}, "budgets.scopes.global.tokens: must be greater"),
        (
            {"scopes": {"global": {"cost_usd": 0}}},
            "budgets.scopes.global.cost_usd: must be greater",
        ),
        ({"scopes": {"per_api_key": {"cost_usd": -2}}}, "budgets.scopes.per_api_key.cost_usd"),
        ({"scopes": {"global": {"cost_usd": float("inf")}}}, "must be finite"),
        ({"scopes": {"global": {"cost_usd": "nan"}}}, "must be finite"),
        ({"scopes": {"per_model": {" ": {"tokens": 1}}}}, "budgets.scopes.per_model: empty model"),
        (
            {"scopes": {"global": {}}},
            "budgets.scopes.global: set tokens, cost_usd, requests or any of them",
        ),
        ({"storage": "disk"}, "budgets.storage: must be memory or redis"),
        ({"windows": [{"id": "d", "period": "1h", "x": 1}]}, "budgets.windows[0].x: unknown"),
        ({"alert_at": [0]}, "budgets.alert_at: alert threshold 0 is not a whole percentage"),
        ({"alert_at": "80"}, "budgets.alert_at: must be a list of whole percentages"),
        (
            {"scopes": {"global": {"tokens": 5, "alert_at": [50, 1001]}}},
            "budgets.scopes.global.alert_at: alert threshold 1001",
        ),
        (
            {"scopes": {"per_model": {"m": {"tokens": 5, "alert_at": [True]}}}},
            "budgets.scopes.per_model.m.alert_at: must be a list",
        ),
    ],
)
def test_each_problem_names_its_field(section: dict[str, object], problem: str) -> None:
    with pytest.raises(BudgetConfigError) as caught:
        parse_budgets(section)
    assert any(p.startswith(problem) or problem in p for p in caught.value.problems), caught.value


def test_validate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(SEED_EXAMPLE)
    assert main(["budgets", "validate", str(good)]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"enabled": True, "windows": [], "scopes": {"global": {"tokens": 0}}})
    )
    assert main(["budgets", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "budgets.scopes.global.tokens" in err


def test_settings_refuse_an_invalid_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "budgets.yaml"
    bad.write_text("windows: [{id: d, period: soon}]\n")
    monkeypatch.setenv("SPENDGUARD_BUDGETS_FILE", str(bad))
    with pytest.raises(ConfigurationError, match=r"SPENDGUARD_BUDGETS_FILE.*windows\[0\]\.period"):
        load_settings()
    monkeypatch.delenv("SPENDGUARD_BUDGETS_FILE")
    with pytest.raises(ConfigurationError, match=r"SPENDGUARD_BUDGETS.*global\.tokens"):
        load_settings(budgets={"scopes": {"global": {"tokens": -1}}})


def test_the_file_is_polled_about_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps({"enabled": False}))
    now = [0.0]
    source = BudgetsSource.from_file(path, monotonic=lambda: now[0])
    path.write_text(json.dumps({"enabled": True}))
    now[0] = 0.5
    assert not source.current().enabled  # not looked at yet
    now[0] = 1.0
    assert source.current().enabled  # noticed: applies from this request on
    path.write_text("{broken")
    now[0] = 2.5
    assert source.current().enabled  # an invalid edit leaves the last good section


def test_alert_thresholds_of_the_section_and_of_a_limit() -> None:
    """The section's ``alert_at`` is every limit's without its own; ``[]`` turns a limit's off."""
    config = parse_budgets(
        {
            "alert_at": [80, 50],
            "windows": [{"id": "h", "period": "1h"}],
            "scopes": {
                "per_api_key": {"tokens": 10},
                "per_model": {
                    "m": {"tokens": 5, "alert_at": [90]},
                    "n": {"tokens": 5, "alert_at": []},
                },
                "global": {"cost_usd": 1},
            },
        }
    )
    assert config.alert_at == (50, 80)
    assert config.per_api_key is not None and config.per_api_key.alert_at == (50, 80)
    assert (config.per_model["m"].alert_at, config.per_model["n"].alert_at) == ((90,), ())
    assert config.global_ is not None and config.global_.alert_at == (50, 80)
    assert config.as_json()["scopes"]["per_model"]["m"] == {"tokens": 5, "alert_at": [90]}
    assert parse_budgets({"windows": [], "scopes": {"global": {"tokens": 1}}}).global_ == (
        BudgetLimit(tokens=1)
    )  # none unless asked for


def test_a_window_may_have_amounts_of_its_own() -> None:
    # A request rate beside a daily quota: the minute counts requests only, the day tokens.
    config = parse_budgets(
        {
            "enabled": True,
            "windows": [{"id": "minute", "period": "1m"}, {"id": "daily", "period": "24h"}],
            "scopes": {
                "per_end_user": {"tokens": 50_000, "windows": {"minute": {"requests": 20}}},
                "per_tag": {"batch": {"windows": {"minute": {"requests": 5, "tokens": 9}}}},
            },
        }
    )
    user = config.per_end_user
    assert user is not None
    assert user.in_window("minute") == BudgetLimit(requests=20)
    assert user.in_window("daily") == BudgetLimit(tokens=50_000, by_window=user.by_window)
    batch = config.per_tag["batch"]
    assert batch.in_window("daily") is None  # no amounts of its own there: not checked
    assert batch.in_window("minute") == BudgetLimit(tokens=9, requests=5)
    assert config.as_json()["scopes"]["per_end_user"] == {
        "tokens": 50_000,
        "windows": {"minute": {"requests": 20}},
    }


@pytest.mark.parametrize(
    ("scope", "problem"),
    [
        ({"windows": {"weekly": {"requests": 1}}}, "per_end_user.windows.weekly: no such window"),
        ({"windows": {"hourly": {"requests": 0}}}, "windows.hourly.requests: must be greater"),
        ({"requests": 1.5}, "per_end_user.requests: must be a whole number"),
        ({"windows": {"hourly": {"windows": {}}}}, "windows.hourly.windows: unknown field"),
        ({"windows": []}, "per_end_user.windows: must map window ids"),
    ],
)
def test_a_windows_own_amounts_are_validated(scope: dict[str, object], problem: str) -> None:
    with pytest.raises(BudgetConfigError) as caught:
        parse_budgets(
            {
                "enabled": True,
                "windows": [{"id": "hourly", "period": "1h"}],
                "scopes": {"per_end_user": scope},
            }
        )
    assert any(problem in p for p in caught.value.problems), caught.value


def test_utc_calendar_windows_reset_with_the_calendar() -> None:
    config = parse_budgets(
        {
            "enabled": True,
            "windows": [
                {"id": "today", "period": "utc:day"},
                {"id": "month", "period": "utc:month"},
                {"id": "rolling", "period": "calendar:month"},  # still an alias of 30d
            ],
            "scopes": {"global": {"tokens": 1}},
        }
    )
    today, month, rolling = config.windows
    assert (today.calendar, month.calendar, rolling.calendar) == (Period.DAY, Period.MONTH, None)
    assert rolling.seconds == 30 * 86_400 and month.seconds == 31 * 86_400
