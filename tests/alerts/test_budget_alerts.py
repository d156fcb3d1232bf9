"""Rolling budgets' threshold alerts end to end in one gateway: fired by the commit that counts
a finished request, moved into the ledger's outbox, delivered signed to a real receiver."""

from __future__ import annotations

from pathlib import Path

import pytest

from spendguard.alerts import SIGNATURE_HEADER, verify
from spendguard.alerts.service import sweep_bucket_alerts
from tests.support.budgets import BudgetGateway, section
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.anyio

SECRET = "whsec-budgets"
# A key may use 60 tokens an hour (alerts at the section's 50 %), the fleet $0.0001 (its own
# 30 %); each request is 15 tokens and 15 micro-USD, and reserves a 10-token output.
BUDGETS = section(
    alert_at=[50],
    default_output_tokens=10,
    windows=[{"id": "hourly", "period": "1h"}],
    scopes={"per_api_key": {"tokens": 60}, "global": {"cost_usd": "0.0001", "alert_at": [30]}},
)


async def test_budget_thresholds_are_delivered_once_signed(tmp_path: Path) -> None:
    with WebhookReceiver() as receiver:
        async with BudgetGateway(
            tmp_path,
            budgets=BUDGETS,
            alert_webhook_url=receiver.url,
            alert_webhook_secret=SECRET,
            alert_interval=3600,
        ) as gw:
            assert (await gw.post()).status_code == 200  # 15 tokens: 25 % and 15 %
            assert await gw.guard.alerts.run_once() == (0, 0)
            assert (await gw.post()).status_code == 200  # 30: both cross
            assert await gw.guard.alerts.run_once() == (2, 2)
            assert (await gw.post()).status_code == 200  # 45: nothing new this hour
            assert await gw.guard.alerts.run_once() == (0, 0)
    got = {d.json["api_key"] or "fleet": d.json for d in receiver.taken}
    assert all(verify(SECRET, d.headers[SIGNATURE_HEADER], d.body) for d in receiver.taken)
    key, fleet = got["alpha"], got["fleet"]
    assert (key["scope"], key["team"], key["window"], key["unit"]) == (
        "budget",
        "acme",
        "hourly",
        "tokens",
    )
    assert (key["threshold_percent"], key["limit_tokens"], key["used_tokens"]) == (50, 60, 30)
    assert key["used_usd"] is None and key["resets_at"] is None
    assert (fleet["unit"], fleet["threshold_percent"], fleet["limit_usd"], fleet["used_usd"]) == (
        "usd",
        30,
        "0.000100",
        "0.000030",
    )
    assert fleet["team"] == "" and fleet["type"] == "spendguard.threshold"


async def test_alerts_a_gateway_never_moved_are_swept_from_every_bucket(tmp_path: Path) -> None:
    async with BudgetGateway(tmp_path, budgets=BUDGETS, alert_interval=3600) as gw:
        for _ in range(2):
            assert (await gw.post()).status_code == 200
        # As another gateway's recovery does once this one is dead: nothing was noted there.
        assert await sweep_bucket_alerts(gw.guard.ledger, gw.gate.memory) == 2
        assert await sweep_bucket_alerts(gw.guard.ledger, gw.gate.memory) == 0
        kept = [a for a, _, _ in await gw.guard.admin.alerts()]
        assert sorted(a.text for a in kept) == [
            "spendguard: acme/alpha reached 50% of its hourly budget of 60 tokens "
            "(30 tokens used in the window)",
            "spendguard: the fleet reached 30% of its hourly budget of $0.000100 "
            "($0.000030 used in the window)",
        ]
