"""The `spendguard` CLI in process: readable output, --json, exit codes, the same settings."""

from __future__ import annotations

import json
from decimal import Decimal
from importlib import resources
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from spendguard.cli import main

ALPHA_DAY = ("--team", "acme", "--api-key", "alpha", "--period", "day")


@pytest.fixture
def db(monkeypatch: pytest.MonkeyPatch, database_url: str) -> str:
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", database_url)
    return database_url


ALPHA_MONTH = ("--team", "acme", "--api-key", "alpha", "--period", "month")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code, out = run(capsys, *args, "--json")
    assert code == 0, out
    return json.loads(out)


def test_policy_lifecycle(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "db", "init")[0] == 0
    code, out = run(capsys, "policy", "set", *ALPHA_DAY, "--limit-usd", "5.00")
    assert code == 0 and "limit $5.000000" in out
    run_json(capsys, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "200")
    fits = run_json(
        capsys, "policy", "set", *ALPHA_MONTH, "--limit-usd", "9", "--mode", "hard", "--fit"
    )
    assert (fits["mode"], fits["fit"]) == ("hard", True)
    assert run(capsys, "policy", "set", *ALPHA_MONTH, "--limit-usd", "9", "--fit")[0] == 2
    assert run_json(capsys, "policy", "rm", *ALPHA_MONTH) == {"removed": True}
    listed = run_json(capsys, "policy", "ls", "--team", "acme")
    assert listed["team"] == "acme"
    assert {(p["api_key"], p["period"], p["limit_micros"]) for p in listed["policies"]} == {
        ("alpha", "day", 5_000_000),
        (None, "month", 200_000_000),
    }
    assert "acme" in run(capsys, "policy", "ls")[1]
    assert run_json(
        capsys, "policy", "rm", "--team", "acme", "--api-key", "alpha", "--period", "day"
    ) == {"removed": True}
    assert (
        run(capsys, "policy", "rm", "--team", "acme", "--api-key", "alpha", "--period", "day")[0]
        == 1
    )
    usage = run_json(capsys, "usage", "--team", "acme")
    month = [s for s in usage["limits"] if s["scope"] == "team" and s["period"] == "month"]
    assert month[0]["limit_micros"] == 200_000_000 and month[0]["settled_micros"] == 0
    assert month[0]["used_micros"] == 0 and month[0]["remaining_micros"] == 200_000_000
    assert month[0]["resets_at"].endswith("T00:00:00Z") and usage["at"].endswith("Z")
    assert run_json(capsys, "settle") == {"settled": 0, "total_micros": 0}


@pytest.mark.parametrize(
    "limit", ["-1", "abc", "0.0000001", "NaN", "1e100", "1000000000000", "1000000000.000001"]
)
def test_bad_limit_is_a_usage_error(
    db: str, capsys: pytest.CaptureFixture[str], limit: str
) -> None:
    code = main(["policy", "set", "--team", "acme", "--period", "day", "--limit-usd", limit])
    assert code == 2
    assert "--limit-usd" in capsys.readouterr().err


def test_bad_settings_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", "mysql://nope")
    assert main(["policy", "ls"]) == 2
    assert "SPENDGUARD_DATABASE_URL" in capsys.readouterr().err


def test_cli_balance_topup_and_show(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "balance", "show", "--team", "acme", "--json")[0] == 1  # no account yet
    topped = run_json(capsys, "balance", "topup", "--team", "acme", "--usd", "100")
    assert topped["balance_micros"] == 100_000_000
    run_json(capsys, "balance", "topup", "--team", "acme", "--usd", "0.5")
    shown = run_json(capsys, "balance", "show", "--team", "acme")
    assert shown["topped_up_micros"] == 100_500_000 and shown["charged_micros"] == 0
    assert shown["mode"] == "soft" and shown["remaining_micros"] == 100_500_000
    assert run(capsys, "balance", "show", "--team", "acme")[1].strip() == (
        "team acme: soft balance $100.500000 (topped up $100.500000, charged $0.000000; "
        "0 records unsettled, estimated $0.000000)"
    )
    assert main(["balance", "topup", "--team", "acme", "--usd", "-1"]) == 2


@pytest.mark.parametrize("usd", ["0", "-5", "1e100", "1000000000000", "1000000000.000001"])
def test_a_top_up_out_of_range_is_a_usage_error_and_nothing_is_written(
    db: str, capsys: pytest.CaptureFixture[str], usd: str
) -> None:
    assert main(["balance", "topup", "--team", "acme", "--usd", usd]) == 2
    err = capsys.readouterr().err
    assert "--usd" in err and "Traceback" not in err
    assert main(["balance", "show", "--team", "acme"]) == 1  # still no account


def test_the_bound_itself_is_accepted(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    # $1,000,000,000: the largest limit or top-up (docs/limits.md, "Amounts").
    code, out = run(capsys, "policy", "set", *ALPHA_DAY, "--limit-usd", "1000000000")
    assert code == 0 and "$1000000000.000000" in out
    assert (
        run_json(capsys, "balance", "topup", "--team", "acme", "--usd", "1000000000")[
            "balance_micros"
        ]
        == 10**15
    )


@pytest.mark.parametrize(
    "args",
    [
        ("balance", "show", "--team", ""),
        ("balance", "topup", "--team", "", "--usd", "5"),
        ("policy", "set", "--team", "", "--period", "day", "--limit-usd", "5"),
        ("usage", "--team", ""),
    ],
)
def test_an_empty_team_is_a_usage_error_without_a_traceback(
    db: str, capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "team_id must be a non-empty string" in err and "Traceback" not in err


def test_every_command_names_its_database_and_store_on_stderr(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "ls", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"policies": []}  # stdout stays machine-readable
    assert "spendguard: database " in captured.err and "; store embedded" in captured.err
    assert db.rsplit("/", 1)[-1] in captured.err or "***" in captured.err


def test_a_relative_sqlite_path_is_named_absolute(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPENDGUARD_DATABASE_URL", raising=False)
    assert main(["policy", "ls"]) == 0
    err = capsys.readouterr().err
    assert f"SQLite file {tmp_path / 'spendguard.db'} (new: it does not exist yet)" in err


def test_usage_of_an_unknown_team_exits_1(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(capsys, "usage", "--team", "nobody")
    assert code == 1
    run(capsys, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "5")
    assert run(capsys, "usage", "--team", "acme")[0] == 0  # a policy: known
    run(capsys, "balance", "topup", "--team", "funded", "--usd", "5")
    assert run(capsys, "usage", "--team", "funded")[0] == 0  # an account: known


def test_usage_of_an_unknown_key_exits_1_and_says_so(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "5")
    assert main(["usage", "--team", "acme", "--api-key", "nosuchkey"]) == 1
    err = capsys.readouterr().err
    assert "key 'nosuchkey' of team 'acme' has no policy and no spend" in err
    run(capsys, "policy", "set", *ALPHA_DAY, "--limit-usd", "1")
    usage = run_json(capsys, "usage", "--team", "acme", "--api-key", "alpha")
    assert usage["api_key"] == "alpha"
    rows = {(r["api_key"], r["period"]) for r in usage["limits"]}
    assert {(None, "month"), ("alpha", "day")} <= rows
    assert {key for key, _ in rows} == {None, "alpha"}


def test_usage_text_shows_what_is_left_and_when_it_resets(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "5")
    usage = run_json(capsys, "usage", "--team", "acme")
    resets = {r["period"]: r["resets_at"] for r in usage["limits"]}
    code, out = run(capsys, "usage", "--team", "acme")
    assert code == 0
    lines = out.splitlines()
    assert (
        f"  {'team':<24} month  used $0.000000 of $5.000000, $5.000000 left; "
        f"resets {resets['month']}"
    ) in lines
    assert lines[-1] == "  0 unsettled records (estimated $0.000000)"


def test_rate_rm_says_what_it_removed(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "rate", "set", "--team", "acme", "--api-key", "k", "--rpm", "60", "--tpm", "9")
    code, out = run(capsys, "rate", "rm", "--team", "acme", "--api-key", "k")
    assert code == 0 and out.strip() == "removed the rates of team acme key k: rpm 60, tpm 9"
    run(capsys, "rate", "set", "--team", "acme", "--max-parallel", "4")
    run(capsys, "rate", "set", "--team", "acme", "--api-key", "k", "--rpm", "1")
    code, out = run(capsys, "rate", "rm", "--team", "acme", "--api-key", "k")
    assert code == 0
    assert out.splitlines() == [
        "removed the rates of team acme key k: rpm 1",
        "rates left:",
        "  (team): max_parallel 4",
    ]
    code, out = run(capsys, "rate", "rm", "--team", "acme", "--api-key", "k")
    assert code == 1 and out.strip() == "team acme key k has no rates to remove"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"spendguard {version('spendguard')}"


# -- prices show: no database is opened (the URL below could not be) ----------------------


@pytest.fixture
def no_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", f"sqlite:///{tmp_path}/missing/dir/x.db")


def test_prices_show_names_the_entry_the_rule_and_the_price(
    no_db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "prices", "show", "openai/gpt-4o-mini-2024-07-18")
    as_of = json.loads(run(capsys, "prices", "show", "gpt-4o", "--json")[1])["as_of"]
    assert code == 0
    assert out.splitlines()[:5] == [
        "openai/gpt-4o-mini-2024-07-18: priced as gpt-4o-mini-2024-07-18 by routing prefix "
        f"removed (openai; shipped table as of {as_of})",
        "  input         $0.15 per 1M tokens",
        "  output        $0.60 per 1M tokens",
        "  cached input  $0.075 per 1M tokens",
        "  cache write   $0.15 per 1M tokens",
    ]
    assert out.splitlines()[5].startswith("  max output ")
    data = run_json(capsys, "prices", "show", "gemini/gemini-2.5-flash")
    assert data["match"] == "gemini-2.5-flash" and data["provider"] == "google"
    assert data["rule"] == "routing_prefix"
    assert data["from_file"] is False and data["unknown_model"] == "default_price"
    shipped = json.loads(
        resources.files("spendguard").joinpath("prices.json").read_text(encoding="utf-8")
    )["models"]["gemini-2.5-flash"]
    assert Decimal(data["price"]["input"]) == Decimal(shipped["input"])
    assert Decimal(data["price"]["cached_input"]) == Decimal(shipped["cached_input"])


def test_prices_show_a_dated_snapshot_says_it_is_priced_as_its_family(
    no_db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "prices", "show", "claude-sonnet-4-5@20250929")
    assert code == 0
    assert out.splitlines()[0].startswith(
        "claude-sonnet-4-5@20250929: priced as claude-sonnet-4-5 by dated snapshot of its family"
    )


@pytest.mark.parametrize("model", ["gpt-4o-mni", "gpt-5.5-turbo", "gpt-4o-mini-preview"])
def test_prices_show_an_unknown_name_is_unknown_and_exits_1(
    no_db: None, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    # A typo or a variant is never priced as the model its name starts with.
    code, out = run(capsys, "prices", "show", model)
    assert code == 1
    assert out.splitlines()[0] == (
        f"{model}: unknown (not in the price table); charged the default price"
    )
    assert "  input         $15.00 per 1M tokens" in out.splitlines()
    code, out = run(capsys, "prices", "show", model, "--json")
    data = json.loads(out)
    assert code == 1 and data["match"] == "default" and data["rule"] == "unknown"


@pytest.mark.parametrize(
    ("rule", "says"), [("reject", "refused with a 400"), ("free", "charged nothing")]
)
def test_prices_show_follows_the_unknown_model_rule(
    no_db: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    rule: str,
    says: str,
) -> None:
    monkeypatch.setenv("SPENDGUARD_UNKNOWN_MODEL", rule)
    code, out = run(capsys, "prices", "show", "no-such-model")
    assert code == 1 and out.strip() == f"no-such-model: unknown (not in the price table); {says}"
    code, out = run(capsys, "prices", "show", "no-such-model", "--json")
    assert json.loads(out)["match"] is None and json.loads(out)["price"] is None


def test_prices_show_reads_a_litellm_price_file(
    no_db: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "model_prices_and_context_window.json"
    path.write_text(
        '{"sample_spec": {"mode": "one of: chat, embedding"},'
        ' "acme-chat-1": {"input_cost_per_token": 1.1e-07, "output_cost_per_token": 4.4e-07,'
        ' "litellm_provider": "acme", "mode": "chat"}}'
    )
    monkeypatch.setenv("SPENDGUARD_PRICES", str(path))
    data = run_json(capsys, "prices", "show", "acme-chat-1")
    assert data["match"] == "acme-chat-1" and data["from_file"] is True
    assert data["provider"] == "acme" and data["file_as_of"] is None
    assert data["price"]["input"] == "0.11" and data["price"]["output"] == "0.44"
    code, out = run(capsys, "prices", "show", "acme-chat-1")
    assert code == 0
    assert "(acme; your price file)" in out.splitlines()[0]


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "spendguard: policies, usage, settlement" in out
    assert "``" not in out  # reST markup printed as is


def test_policy_set_on_a_team_spelled_like_another_hints_at_it(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def policy_set(team: str, period: str = "day") -> tuple[int, str]:
        code = main(["policy", "set", "--team", team, "--period", period, "--limit-usd", "5"])
        return code, capsys.readouterr().err

    assert "has no policy yet" not in policy_set("acme")[1]  # the ledger's first team
    code, err = policy_set("acmee")
    # Still set (a new team is allowed), but not silently.
    assert code == 0 and "team 'acmee' has no policy yet" in err and "did you mean acme?" in err
    assert "teams with policies: acme, acmee" in policy_set("zeta")[1]
    assert "has no policy yet" not in policy_set("acme", "month")[1]  # a team the ledger knows


@pytest.mark.anyio
@pytest.mark.parametrize(("pending", "said"), [(1, "1 record pending"), (2, "2 records pending")])
async def test_doctor_gateway_counts_records_in_words(
    monkeypatch: pytest.MonkeyPatch, pending: int, said: str
) -> None:
    import httpx

    from spendguard import Settings, doctor

    status = {
        "lifespan": "lifespan",
        "running": True,
        "record_writer": {"running": True, "pending": pending},
        "worker": {"running": True},
        "store": {"mode": "embedded"},
    }
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=status))
    real = httpx.AsyncClient
    monkeypatch.setattr(doctor.httpx, "AsyncClient", lambda **kw: real(transport=transport, **kw))
    settings = Settings(admin_token="t", database_url="sqlite:///unused.db")
    found = await doctor.check_gateway(doctor.DoctorContext(settings, gateway="http://gw/admin"))
    assert said in found.detail


def test_a_customers_prepaid_balance_from_the_cli(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "db", "init")[0] == 0
    assert run(capsys, "budgets", "customer-balance", "--customer", "globex")[0] == 1
    opened = run_json(capsys, "budgets", "customer-topup", "--customer", "globex", "--usd", "5")
    again = run_json(capsys, "budgets", "customer-topup", "--customer", "globex", "--usd", "2.5")
    shown = run_json(capsys, "budgets", "customer-balance", "--customer", "globex")
    assert opened["topped_up_micros"] == 5_000_000
    assert again["topped_up_micros"] == shown["topped_up_micros"] == 7_500_000
    assert shown["used_micros"] is None  # without Redis each gateway counts its own use
    assert run(capsys, "budgets", "customer-topup", "--customer", "globex", "--usd", "0")[0] == 2
