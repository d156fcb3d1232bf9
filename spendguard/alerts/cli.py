"""``spendguard alerts ...``: the newest alerts and where their delivery stands, one delivery
pass of the outbox, and a sample sent to the configured webhook."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..clock import time_text
from ..engine.views import alert_test_json, alerts_json
from ..ledger import Ledger
from ..limits import KeyCodec
from ..settings import Settings
from ..store import MemoryStore, Store
from .service import AlertService


def service_for(
    settings: Settings, ledger: Ledger, store: Store | None, codec: KeyCodec
) -> AlertService:
    # Without Redis the CLI moves no alerts (they live in each gateway): an empty store.
    return AlertService.from_settings(
        settings, ledger, store if store is not None else MemoryStore(), codec
    )


async def run(args: argparse.Namespace, service: AlertService) -> int:
    cmd = args.alerts_cmd
    if cmd == "test":
        alert, error = await service.send_sample()
        data = alert_test_json(alert, error)
        text = (
            f"sample alert {alert.id} delivered to {service.webhook_url}"
            if error is None
            else f"sample alert not delivered to {service.webhook_url}: {error}"
        )
        _emit(args, data, text)
        return 0 if error is None else 1
    if cmd == "deliver":
        sent = await service.deliver()
        _emit(args, {"delivered": sent}, f"{sent} alert{'' if sent == 1 else 's'} delivered")
        return 0
    if not 1 <= args.limit <= 1000:
        raise ValueError("--limit: 1 to 1000")
    rows = await service.ledger.recent_alerts(args.limit)
    lines = []
    for alert, done, attempts in rows:
        state = f"delivered {time_text(done)}" if done else f"pending ({attempts} attempts)"
        lines.append(
            f"{time_text(alert.fired_at)}  {alert.text.removeprefix('spendguard: ')}  [{state}]"
        )
    _emit(args, alerts_json(rows), "\n".join(lines) or "no alerts")
    return 0


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    alerts = sub.add_parser("alerts", help="threshold alerts").add_subparsers(
        dest="alerts_cmd", required=True
    )
    ls = alerts.add_parser("ls", parents=[common], help="the newest alerts and their delivery")
    ls.add_argument("--limit", type=int, default=20, help="how many (1 to 1000)")
    alerts.add_parser("deliver", parents=[common], help="send what the outbox holds, once")
    alerts.add_parser("test", parents=[common], help="send a sample alert to the webhook")
