"""Threshold alerts end to end in one gateway: fired by the postflight, moved into the ledger's
outbox, delivered signed to a real HTTP receiver, retried while it is down, never twice."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest

from spendguard.alerts import SIGNATURE_HEADER, verify
from spendguard.limits import Period
from tests.support import Gateway, Override
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.anyio

SECRET = "whsec-test"


def gateway(tmp_path: Path, receiver: WebhookReceiver | None, **kw: object) -> Gateway:
    hook = {} if receiver is None else {"alert_webhook_url": receiver.url}
    return Gateway(
        tmp_path,
        alert_thresholds="50,80,100",
        alert_webhook_secret=SECRET,
        **hook,
        **kw,  # type: ignore[arg-type]
    )


async def spend(gw: Gateway, requests: int) -> None:
    for _ in range(requests):  # 15 micro-USD each
        assert (await gw.post()).status_code == 200


async def test_each_threshold_is_delivered_once_signed(tmp_path: Path) -> None:
    with WebhookReceiver() as receiver:
        async with gateway(tmp_path, receiver) as gw:
            await gw.policy(Period.DAY, 300)  # the key's day: 300 micro-USD
            await spend(gw, 9)  # 135: nothing yet
            assert await gw.guard.alerts.run_once() == (0, 0)
            await spend(gw, 1)  # 150: 50 %
            await spend(gw, 7)  # 255: 80 % (240) on the way
            assert await gw.guard.alerts.run_once() == (2, 2)
            await spend(gw, 3)  # 300: 100 %
            assert await gw.guard.alerts.run_once() == (1, 1)
            assert await gw.guard.alerts.run_once() == (0, 0)
    got = receiver.taken
    assert [d.json["threshold_percent"] for d in got] == [50, 80, 100]
    assert [d.json["used_micros"] for d in got] == [150, 240, 300]
    assert len({d.headers["idempotency-key"] for d in got}) == 3
    for d in got:
        assert d.json["id"] == d.headers["idempotency-key"]
        assert d.json["limit_micros"] == 300 and d.json["window"] == "day"
        assert d.json["team"] == "acme" and d.json["api_key"] == "alpha"
        assert d.json["resets_at"] == "2026-10-01T00:00:00Z"
        assert verify(SECRET, d.headers[SIGNATURE_HEADER], d.body)
        assert not verify("another secret", d.headers[SIGNATURE_HEADER], d.body)
        assert not verify(SECRET, d.headers[SIGNATURE_HEADER], d.body + b" ")


async def test_a_receiver_that_is_down_gets_every_alert_once_it_is_back(tmp_path: Path) -> None:
    with WebhookReceiver() as receiver:
        async with gateway(tmp_path, receiver) as gw:
            await gw.policy(Period.DAY, 300)
            receiver.status = 503
            await spend(gw, 20)  # every threshold
            assert await gw.guard.alerts.run_once() == (3, 0)
            assert receiver.refused == 3
            # Backing off: nothing is sent again before its time.
            assert await gw.guard.alerts.run_once() == (0, 0)
            assert receiver.refused == 3
            for _ in range(8):  # 60 s of outage, retried as the backoff allows
                gw.clock.now += timedelta(seconds=8)
                assert await gw.guard.alerts.run_once() == (0, 0)
            refused = receiver.refused
            assert 3 * 4 <= refused <= 3 * 8  # retried, and backing off
            receiver.status = 200
            delivered = 0
            for _ in range(4):  # all due within the backoff's cap; a send lost on a loaded
                gw.clock.now += timedelta(seconds=60)  # runner is retried like any other
                delivered += (await gw.guard.alerts.run_once())[1]
                if delivered == 3:
                    break
            assert delivered == 3
            gw.clock.now += timedelta(seconds=600)
            assert await gw.guard.alerts.run_once() == (0, 0)
            recent = await gw.guard.ledger.recent_alerts()
    ids = [d.headers["idempotency-key"] for d in receiver.taken]
    assert len(ids) == len(set(ids)) == 3
    assert all(done is not None and attempts > 4 for _, done, attempts in recent)


async def test_without_a_webhook_each_alert_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "spendguard.alerts")
    async with gateway(tmp_path, None) as gw:
        await gw.policy(Period.DAY, 300)
        await gw.policy(Period.MONTH, 3000, key=None)
        await spend(gw, 10)
        assert await gw.guard.alerts.run_once() == (1, 1)
        assert await gw.guard.alerts.run_once() == (0, 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "spendguard.alerts"]
    assert lines == [
        "spendguard: acme/alpha reached 50% of its day limit of $0.000300 ($0.000150 used, "
        "resets 2026-10-01T00:00:00Z)"
    ]


async def test_alerts_off_fire_nothing_and_ask_the_store_for_nothing(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        await gw.policy(Period.DAY, 30)
        await spend(gw, 2)
        assert [c for c in gw.store.calls if "alert" in c] == []
        key = gw.guard.codec.alerts_key("acme")
        assert await gw.guard.store.pending_alerts(key) == {}
        assert await gw.guard.ledger.recent_alerts() == []


async def test_a_stopping_gateway_moves_what_it_fired(tmp_path: Path) -> None:
    async with gateway(tmp_path, None, alert_interval=3600) as gw:
        await gw.policy(Period.DAY, 30)
        await spend(gw, 2)
    # stopped: its last pass moved the alerts it fired into the outbox
    ledger = gw.guard.ledger
    await ledger.connect()
    try:
        assert [a.percent for a, _, _ in await ledger.recent_alerts()] == [100, 80, 50]
    finally:
        await ledger.disconnect()


@pytest.mark.parametrize("bad", ["0", "1001", "x", "50,-1", "12.5"])
def test_thresholds_are_whole_percentages(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="alert_thresholds"):
        Gateway(tmp_path, alert_thresholds=bad)


async def test_a_limit_projected_to_run_out_alerts_once_per_window(tmp_path: Path) -> None:
    with WebhookReceiver() as receiver:
        async with gateway(tmp_path, receiver, alert_projected=True, alert_interval=3600) as gw:
            await gw.policy(Period.DAY, 1000)
            await gw.policy(Period.MONTH, 10**9, key=None)  # far from running out
            noon = gw.clock.now
            gw.clock.now = noon - timedelta(hours=5)
            await spend(gw, 10)  # 150
            gw.clock.now = noon - timedelta(minutes=30)
            await spend(gw, 20)  # 450 in all, 300 of it in the last hour
            gw.clock.now = noon + timedelta(seconds=61)  # the next forecast is due
            await gw.settle()
            assert await gw.guard.alerts.run_once() == (1, 1)
            gw.clock.now += timedelta(seconds=61)
            await spend(gw, 1)
            assert await gw.guard.alerts.run_once() == (0, 0)  # the same limit and window
    [got] = [d.json for d in receiver.taken]
    assert got["type"] == "spendguard.projected" and got["window"] == "day"
    assert got["used_micros"] == 450 and got["limit_micros"] == 1000
    # (300 + 450 / 24) / 2 = 159.375 per hour: the 550 left last 12,424 s (rounded up)
    assert got["runs_out_at"] == "2026-09-30T15:28:05Z"
    assert got["fired_at"] == "2026-09-30T12:01:01Z"


async def test_an_alert_fired_while_its_team_is_being_moved_goes_with_the_next_pass(
    tmp_path: Path,
) -> None:
    with WebhookReceiver() as receiver:
        async with gateway(tmp_path, receiver, alert_interval=3600) as gw:
            await gw.policy(Period.DAY, 300)
            await spend(gw, 10)  # 150: 50 %
            service = gw.guard.alerts
            real = service.store
            fired_meanwhile = False

            async def pending_alerts(key: str) -> dict[str, str]:
                nonlocal fired_meanwhile
                found: dict[str, str] = await real.pending_alerts(key)
                if not fired_meanwhile:
                    fired_meanwhile = True
                    await spend(gw, 7)  # 255: 80 % fires after the pass read the store
                return found

            service.store = Override(real, pending_alerts=pending_alerts)  # type: ignore[assignment]
            assert await service.run_once() == (1, 1)  # the 50 % it read
            assert await service.run_once() == (1, 1)  # the 80 %, noted meanwhile
            assert await service.run_once() == (0, 0)
    assert [d.json["threshold_percent"] for d in receiver.taken] == [50, 80]
