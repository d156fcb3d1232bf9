"""A limit's own alert thresholds, set through the Python admin API and the CLI: they replace
the gateway's default for that limit, reach a running gateway at once, and silence it when
empty."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spendguard.cli import main
from spendguard.errors import StoreUnavailable
from spendguard.store import MemoryStore
from tests.support import Gateway
from tests.support.clock import Clock
from tests.support.doubles import Override

pytestmark = pytest.mark.anyio


async def spend(gw: Gateway, requests: int) -> None:
    for _ in range(requests):  # 15 micro-USD each
        assert (await gw.post()).status_code == 200


async def fired(gw: Gateway) -> list[tuple[str, str, int]]:
    await gw.guard.alerts.run_once()
    return sorted(
        (a.api_key or "-", a.window, a.percent) for a, _, _ in await gw.guard.admin.alerts()
    )


async def test_own_thresholds_replace_the_default_and_empty_ones_silence(tmp_path: Path) -> None:
    async with Gateway(tmp_path, alert_thresholds="50", alert_interval=3600) as gw:
        admin = gw.guard.admin
        await admin.set_policy("acme", "alpha", window="day", limit_usd="0.0001", alert_at=[30])
        await admin.set_policy("acme", "alpha", window="month", limit_usd="0.0001", alert_at="")
        await admin.set_policy("acme", None, window="day", limit_usd="0.0001")
        await spend(gw, 4)  # 60 of each 100
        assert await fired(gw) == [
            ("-", "day", 50),  # the default, on the limit without its own
            ("alpha", "day", 30),  # its own 30 %, and not the default 50 %
        ]  # and nothing of the key's month: it never alerts


async def test_a_change_reaches_a_running_gateway_and_is_kept(tmp_path: Path) -> None:
    async with Gateway(tmp_path, alert_interval=3600) as gw:  # no default thresholds
        admin = gw.guard.admin
        await admin.set_policy("acme", "alpha", window="day", limit_usd="0.0001", alert_at=[90])
        await spend(gw, 2)  # 30 %: below its own 90 %
        assert await fired(gw) == []
        saved = await admin.set_policy(
            "acme", "alpha", window="day", limit_usd="0.0001", alert_at="20,40"
        )
        assert saved.alert_at == (20, 40)
        await spend(gw, 1)  # 45 %: both, at the very next request
        assert await fired(gw) == [("alpha", "day", 20), ("alpha", "day", 40)]
        kept = await admin.set_policy("acme", "alpha", window="day", limit_usd="0.0002")
        assert kept.alert_at == (20, 40)
        back = await admin.set_policy(
            "acme", "alpha", window="day", limit_usd="0.0002", alert_at="default"
        )
        assert back.alert_at is None
        for bad in ([0], "fifty", [50, 1001]):
            with pytest.raises(ValueError, match="alert threshold"):
                await admin.set_policy("acme", "alpha", window="day", limit_usd="1", alert_at=bad)
        assert [p.amount for p in await admin.list_policies("acme")] == [200]


def test_the_cli_sets_lists_and_refuses_thresholds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    key = ["--team", "acme", "--api-key", "alpha"]

    def run(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().out

    code, out = run("policy", "set", *key, "--period", "day", "--limit-usd", "5",
                    "--alert-at", "80,50", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["alert_at"] == [50, 80]
    code, out = run("policy", "set", *key, "--period", "month", "--limit-usd", "50",
                    "--alert-at", "none")  # fmt: skip
    assert code == 0 and "alerts at none" in out
    code, out = run("policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "9")
    assert code == 0 and "alerts at the default" in out
    code, out = run("policy", "ls", "--team", "acme")
    rows = {tuple(line.split()[1:3]): line.split()[-1] for line in out.splitlines()[1:]}
    assert rows == {
        ("alpha", "day"): "50%,80%",
        ("alpha", "month"): "none",
        ("-", "month"): "default",
    }
    code, out = run("policy", "set", *key, "--period", "day", "--limit-usd", "5",
                    "--alert-at", "0")  # fmt: skip
    assert code == 2
    code, out = run("policy", "ls", "--team", "acme", "--json")
    assert [p["alert_at"] for p in json.loads(out)["policies"]] == [None, [50, 80], []]


async def test_a_prepaid_balance_alerts_as_it_is_used_and_again_after_a_top_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", "spendguard.alerts")
    async with Gateway(tmp_path, alert_thresholds="80", alert_interval=3600) as gw:
        await gw.guard.admin.topup("acme", "0.0001")
        await spend(gw, 5)  # 75 of 100
        assert await fired(gw) == []
        await spend(gw, 1)  # 90
        assert await fired(gw) == [("-", "balance", 80)]
        await gw.guard.admin.topup("acme", "0.0001")  # 200 topped up: 80 % is 160
        await spend(gw, 4)  # 150
        assert await fired(gw) == [("-", "balance", 80)]
        await spend(gw, 1)  # 165
        assert await fired(gw) == [("-", "balance", 80), ("-", "balance", 80)]
        [data] = [a.as_json() for a, _, _ in await gw.guard.admin.alerts() if a.limit_micros == 200]
        assert (data["window"], data["limit_micros"], data["used_micros"]) == ("balance", 200, 165)
        assert data["resets_at"] is None
    lines = [r.getMessage() for r in caplog.records if r.name == "spendguard.alerts"]
    assert lines[-1] == (
        "spendguard: acme used 80% of its prepaid balance of $0.000200 ($0.000165 used, "
        "$0.000035 left)"
    )


async def test_an_alert_whose_postflight_reply_was_lost_is_still_moved(tmp_path: Path) -> None:
    """The postflight ran and fired, but its reply never came back (a timeout): the gateway
    can't know it fired, so it looks in the team's pending alerts on the next pass anyway."""
    clock = Clock()
    store = MemoryStore(clock=clock)

    async def lost_reply(*args: Any, **kwargs: Any) -> Any:
        await store.postflight(*args, **kwargs)
        raise StoreUnavailable("reply lost")

    flaky = Override(store, postflight=lost_reply)
    gateway = Gateway(tmp_path, clock, store=flaky, alert_thresholds="50", alert_interval=3600)
    async with gateway as gw:
        await gw.guard.admin.set_policy("acme", "alpha", window="day", limit_usd="0.00003")
        await spend(gw, 1)  # 15 of 30: fired, reply lost
        assert await fired(gw) == [("alpha", "day", 50)]
