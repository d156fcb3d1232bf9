"""``spendguard budgets ...``: validate a file, inspect and reset counters, per-key budgets.

``validate`` needs nothing but the file. The others read the same ``SPENDGUARD_*`` settings as
the gateway; inspect and reset reach the counters only with Redis (memory counters live inside
each gateway process: use the gateway's admin API there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..engine.views import (
    budget_report_json,
    budget_reset_json,
    key_budget_json,
    removed_json,
)
from ..errors import ConfigurationError
from ..ledger import BudgetOverride, Ledger
from ..settings import Settings
from ..store import MemoryStore, Store, make_store
from .admin import BudgetAdmin
from .config import (
    DISABLED,
    BudgetConfigError,
    BudgetsConfig,
    Scope,
    Storage,
    parse_budgets,
    read_budgets,
)


def validate(args: argparse.Namespace) -> int:
    """Exit 0 when the file is valid, 2 with every problem (one per line) when it isn't."""
    try:
        config = read_budgets(Path(args.file))
    except BudgetConfigError as exc:
        for problem in exc.problems:
            print(f"spendguard: {problem}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(config.as_json(), indent=2))
    else:
        state = "enabled" if config.enabled else "disabled"
        print(
            f"{args.file}: valid ({state}, {len(config.windows)} windows, "
            f"{len(config.per_model)} per-model limits)"
        )
    return 0


def configured(settings: Settings) -> BudgetsConfig:
    if settings.budgets_file is not None:
        return read_budgets(settings.budgets_file)
    if settings.budgets is not None:
        return parse_budgets(settings.budgets)
    return DISABLED


def admin_for(settings: Settings, ledger: Ledger) -> tuple[BudgetAdmin, Store | None]:
    """An admin on the shared counters (None as the store without Redis)."""
    config = configured(settings)
    store: Store | None = None
    if settings.redis_url is not None and config.storage is Storage.REDIS:
        store = make_store(settings)
    return BudgetAdmin(config, store or MemoryStore(), ledger=ledger), store


async def run(args: argparse.Namespace, settings: Settings, ledger: Ledger) -> int:
    admin, store = admin_for(settings, ledger)
    try:
        return await _dispatch(args, admin, store)
    finally:
        if store is not None:
            await store.aclose()


async def _dispatch(args: argparse.Namespace, admin: BudgetAdmin, store: Store | None) -> int:
    cmd = args.budgets_cmd
    if cmd in ("inspect", "reset") and store is None:
        raise ConfigurationError(
            "budget counters in memory live inside each gateway: use storage: redis with "
            "SPENDGUARD_REDIS_URL, or the gateway's admin API"
        )
    if cmd == "inspect":
        report = await admin.inspect()
        data = budget_report_json(report)
        lines = [f"budgets: {'enabled' if report.config.enabled else 'disabled'}"]
        lines += [
            f"  {c.scope.value:<12} {c.subject or '-':<30} {c.window:<10} "
            f"tokens {c.tokens} cost_micro_usd {c.cost_micros} requests {c.requests}"
            for c in report.counters
        ]
        print(json.dumps(data, indent=2) if args.json else "\n".join(lines))
        return 0
    if cmd == "reset":
        n = await admin.reset(
            args.scope,
            window=args.window,
            team_id=args.team,
            api_key_id=args.api_key,
            model=args.model,
            end_user=args.end_user,
            tag=args.tag,
            customer=args.customer,
        )
        bucket = "bucket" if n == 1 else "buckets"
        print(json.dumps(budget_reset_json(n), indent=2) if args.json else f"reset {n} {bucket}")
        return 0
    if cmd in ("customer-topup", "customer-balance"):
        if cmd == "customer-topup":
            account = await admin.topup_customer(args.customer, args.usd)
        else:
            found = await admin.customer_balance(args.customer)
            if found is None:
                print(f"customer {args.customer!r} has no prepaid account", file=sys.stderr)
                return 1
            account = found
        data = account.as_json()
        if store is None:  # its use is counted in each gateway's memory: unknown here
            data["used_micros"] = data["balance_micros"] = data["balance_usd"] = None
        text = f"customer {account.customer}: topped up ${data['topped_up_usd']}"
        if store is not None:
            text += f", balance ${data['balance_usd']}"
        print(json.dumps(data, indent=2) if args.json else text)
        return 0
    if cmd == "key-set":
        o = await admin.set_key_budget(
            args.team, args.api_key, max_tokens=args.max_tokens, budget_window=args.window
        )
        data = key_budget_json(o)
        text = f"key budget set: team {o.team_id} key {o.api_key_id}: {_key_budget_text(o)}"
        print(json.dumps(data, indent=2) if args.json else text)
        return 0
    if cmd == "key-rm":
        removed = await admin.remove_key_budget(args.team, args.api_key)
        text = "key budget removed" if removed else "no such key budget"
        print(json.dumps(removed_json(removed), indent=2) if args.json else text)
        return 0 if removed else 1
    overrides = await admin.key_budgets()
    rows = [key_budget_json(o) for o in overrides]
    lines = [f"{o.team_id:<20} {o.api_key_id:<20} {_key_budget_text(o)}" for o in overrides]
    print(json.dumps(rows, indent=2) if args.json else "\n".join(lines) or "no key budgets")
    return 0


def _key_budget_text(o: BudgetOverride) -> str:
    return f"{o.max_tokens:,} tokens per {o.budget_window}"


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``budgets`` command group (``validate`` marked to run without settings)."""
    bud = sub.add_parser("budgets", help="token and USD budgets").add_subparsers(
        dest="budgets_cmd", required=True
    )
    val = bud.add_parser("validate", parents=[common], help="check a budgets file (exit 2: bad)")
    val.add_argument("file")
    val.set_defaults(standalone=validate)
    bud.add_parser("inspect", parents=[common], help="config and counters (Redis)")
    reset = bud.add_parser("reset", parents=[common], help="clear recorded usage (Redis)")
    reset.add_argument("--scope", required=True, choices=[s.value for s in Scope])
    reset.add_argument("--window", default=None)
    reset.add_argument("--team", default=None, help="with --api-key: one key (per_api_key)")
    reset.add_argument("--api-key", default=None)
    reset.add_argument("--model", default=None, help="one model (per_model)")
    reset.add_argument("--end-user", default=None, help="with --team: one (per_end_user)")
    reset.add_argument("--tag", default=None, help="one tag (per_tag)")
    reset.add_argument("--customer", default=None, help="one customer (per_customer)")
    key_set = bud.add_parser("key-set", parents=[common], help="a key's own token budget")
    key_rm = bud.add_parser("key-rm", parents=[common], help="remove a key's own budget")
    for p in (key_set, key_rm):
        p.add_argument("--team", required=True)
        p.add_argument("--api-key", required=True)
    key_set.add_argument("--max-tokens", type=int, required=True, help="max_tokens_budget")
    key_set.add_argument("--window", required=True, help="budget_window, e.g. 24h or 30d")
    bud.add_parser("key-ls", parents=[common], help="keys with their own budget")
    c_top = bud.add_parser(
        "customer-topup", parents=[common], help="add to a customer's prepaid balance"
    )
    c_show = bud.add_parser(
        "customer-balance", parents=[common], help="a customer's prepaid balance (exit 1: none)"
    )
    for p in (c_top, c_show):
        p.add_argument("--customer", required=True, help="as the app names it")
    c_top.add_argument("--usd", required=True, help="e.g. 100.00")
