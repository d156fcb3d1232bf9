"""``spendguard``: policies, usage, settlement and schema from the command line (R10.1).

Reads the same ``SPENDGUARD_*`` settings as the middleware. Readable output by default,
``--json`` for scripts. Exit codes: 0 ok, 1 not found / nothing to do, 2 usage or config error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import anyio

from .costing import Coster
from .errors import ConfigurationError, SpendGuardError, StoreUnavailable
from .guard import make_store
from .identity import Identity
from .keys import Scope, balance_key, policy_field, usage_key
from .ledger import Ledger, SpendRow
from .money import micros_to_usd, usd_to_micros
from .periods import Period, period_id, utcnow
from .pricing import PriceTable
from .settings import Settings, load_settings
from .store.base import RefreshEntry
from .store.redis import RedisStore
from .worker import SettlementWorker


@dataclass(frozen=True, slots=True)
class Ctx:
    settings: Settings
    ledger: Ledger
    store: RedisStore | None  # the embedded store lives in the gateway: out of the CLI's reach


Handler = Callable[[argparse.Namespace, Ctx], Awaitable[int]]


def _usd(micros: int | None) -> str | None:
    return None if micros is None else str(micros_to_usd(micros))


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _identity(args: argparse.Namespace) -> Identity:
    try:
        return Identity(args.team, getattr(args, "api_key", None))
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from exc


# -- commands --------------------------------------------------------------------------------
async def cmd_db_init(args: argparse.Namespace, ctx: Ctx) -> int:
    _emit(args, {"ok": True}, "schema ready")
    return 0


async def cmd_policy_set(args: argparse.Namespace, ctx: Ctx) -> int:
    ident = _identity(args)
    try:
        limit = usd_to_micros(Decimal(args.limit_usd))
    except (ValueError, ArithmeticError) as exc:
        raise ConfigurationError(f"--limit-usd: {exc}") from exc
    if limit < 0:
        raise ConfigurationError("--limit-usd must be >= 0")
    row = await ctx.ledger.set_policy(
        team=ident.team,
        team_id=ident.team_id,
        api_key=ident.api_key,
        api_key_id=ident.api_key_id,
        period=Period(args.period),
        limit_micros=limit,
    )
    await _evict(ctx, ident, row.period)
    data = _policy_json(row.team_id, row.api_key_id, row.period, row.limit_micros)
    who = f"team {row.team_id}" + (f" key {row.api_key_id}" if row.api_key_id else "")
    _emit(args, data, f"policy set: {who} {row.period.value} limit ${_usd(row.limit_micros)}")
    return 0


async def cmd_policy_rm(args: argparse.Namespace, ctx: Ctx) -> int:
    ident = _identity(args)
    removed = await ctx.ledger.remove_policy(
        team=ident.team, api_key=ident.api_key, period=Period(args.period)
    )
    await _evict(ctx, ident)
    _emit(args, {"removed": removed}, "policy removed" if removed else "no such active policy")
    return 0 if removed else 1


async def cmd_policy_ls(args: argparse.Namespace, ctx: Ctx) -> int:
    team = Identity(args.team).team if args.team else None
    rows = await ctx.ledger.list_policies(team)
    data = [_policy_json(r.team_id, r.api_key_id, r.period, r.limit_micros) for r in rows]
    lines = [f"{'TEAM':<20} {'API KEY':<20} {'PERIOD':<6} LIMIT USD"] + [
        f"{r.team_id:<20} {r.api_key_id or '-':<20} {r.period.value:<6} {_usd(r.limit_micros)}"
        for r in rows
    ]
    _emit(args, data, "\n".join(lines) if rows else "no policies")
    return 0


async def cmd_usage(args: argparse.Namespace, ctx: Ctx) -> int:
    ident = _identity(args)
    now = utcnow()
    day, month = period_id(Period.DAY, now), period_id(Period.MONTH, now)
    spend = await ctx.ledger.spend(ident.team, day, month)
    policy_rows = await ctx.ledger.list_policies(ident.team)
    policies = {(p.api_key, p.period): p.limit_micros for p in policy_rows}
    aggs = {
        (r["api_key"] or None, r["period"], r["period_id"]): int(r["settled_micros"])
        for r in await ctx.ledger.aggregate_rows(ident.team)
    }
    count, estimates = await ctx.ledger.unsettled(ident.team)
    # Limits with no spend yet still show, at 0.
    seen = {(r.api_key, r.period) for r in spend}
    spend += [
        SpendRow(p.api_key, p.api_key_id, p.period, day if p.period is Period.DAY else month, 0)
        for p in policy_rows
        if (p.api_key, p.period) not in seen
    ]
    scopes = []
    for row in spend:
        if ident.api_key is not None and row.api_key not in (None, ident.api_key):
            continue
        limit = policies.get((row.api_key, row.period))
        scopes.append(
            {
                "scope": "team" if row.api_key is None else "api_key",
                "api_key": row.api_key_id if row.api_key else None,
                "period": row.period.value,
                "period_id": row.period_id,
                "settled_micros": row.spent_micros,
                "settled_usd": _usd(row.spent_micros),
                "limit_micros": limit,
                "limit_usd": _usd(limit),
                "aggregate_micros": aggs.get((row.api_key, row.period.value, row.period_id)),
            }
        )
    data = {
        "team": ident.team_id,
        "day": day,
        "month": month,
        "scopes": scopes,
        "charges_total_micros": await ctx.ledger.charges_total(ident.team),
        "unsettled_records": count,
        "unsettled_estimate_micros": estimates,
        # The embedded store lives inside the gateway process: the CLI can't read its cache.
        "cached": await _cached(ctx, ident, scopes),
    }
    lines = [f"team {ident.team_id}: day {day}, month {month}"]
    for s in scopes:
        who = "team" if s["scope"] == "team" else f"key {s['api_key']}"
        lim = f" of ${s['limit_usd']}" if s["limit_usd"] is not None else " (no limit)"
        lines.append(f"  {who:<24} {s['period']:<6} settled ${s['settled_usd']}{lim}")
    lines.append(f"  unsettled records: {count} (estimated ${_usd(estimates)})")
    _emit(args, data, "\n".join(lines))
    return 0


async def _evict(ctx: Ctx, ident: Identity, period: Period | None = None) -> None:
    """R9.2: a policy change takes effect at once in Redis. The embedded store of a running
    gateway picks it up on its next settlement pass.

    A (re)activated limit's usage key may still hold a stale value from before (it outlives
    a removed policy): it is raised to the aggregate the activation just rebuilt.
    """
    if ctx.store is not None:
        try:
            await ctx.store.evict_policy(ident.team, ctx.settings.key_prefix)
            if period is not None:
                pid = period_id(period, utcnow())
                wanted = (ident.api_key, period, pid)
                agg = (await ctx.ledger.load_aggregates(ident.team, [wanted]))[wanted]
                scope = Scope.API_KEY if ident.api_key else Scope.TEAM
                field = policy_field(scope, period, ident.api_key)
                key = usage_key(ctx.settings.key_prefix, ident.team, field, pid)
                await ctx.store.refresh([RefreshEntry(key, agg)])
        except StoreUnavailable as exc:
            print(
                f"spendguard: policy saved, cache not evicted ({exc}); it expires in "
                f"{ctx.settings.policy_ttl:g}s",
                file=sys.stderr,
            )


async def cmd_balance_topup(args: argparse.Namespace, ctx: Ctx) -> int:
    ident = Identity(args.team)
    try:
        micros = usd_to_micros(Decimal(args.usd))
    except (ValueError, ArithmeticError) as exc:
        raise ConfigurationError(f"--usd: {exc}") from exc
    if micros <= 0:
        raise ConfigurationError("--usd must be positive")
    topped_up, charged = await ctx.ledger.topup(
        team=ident.team, team_id=ident.team_id, micros=micros
    )
    if ctx.store is not None:
        try:
            # A first top-up creates the account: the cached policy hash must learn of it.
            await ctx.store.evict_policy(ident.team, ctx.settings.key_prefix)
            key = balance_key(ctx.settings.key_prefix, ident.team)
            await ctx.store.refresh([RefreshEntry(key, charged, limit=topped_up)])
        except StoreUnavailable as exc:
            print(f"spendguard: top-up saved, cache not updated ({exc})", file=sys.stderr)
    data = _balance_json(ident, topped_up, charged)
    _emit(args, data, f"team {ident.team_id}: balance ${data['balance_usd']}")
    return 0


async def cmd_balance_show(args: argparse.Namespace, ctx: Ctx) -> int:
    ident = Identity(args.team)
    account = await ctx.ledger.load_balance(ident.team)
    if account is None:
        _emit(args, {"team": ident.team_id, "account": None}, "no balance account (unlimited)")
        return 1
    data = _balance_json(ident, *account)
    count, estimates = await ctx.ledger.unsettled(ident.team)
    data["unsettled_estimate_micros"] = estimates
    data["cached_micros"] = None
    if ctx.store is not None:
        key = balance_key(ctx.settings.key_prefix, ident.team)
        try:
            used = (await ctx.store.read_usage([key]))[key]
            data["cached_micros"] = None if used is None else account[0] - used
        except StoreUnavailable:
            pass
    _emit(
        args,
        data,
        f"team {ident.team_id}: balance ${data['balance_usd']} (topped up "
        f"${_usd(account[0])}, charged ${_usd(account[1])}; {count} records unsettled, "
        f"estimated ${_usd(estimates)})",
    )
    return 0


def _balance_json(ident: Identity, topped_up: int, charged: int) -> dict[str, Any]:
    return {
        "team": ident.team_id,
        "topped_up_micros": topped_up,
        "charged_micros": charged,
        "balance_micros": topped_up - charged,
        "balance_usd": str(micros_to_usd(topped_up - charged)),
    }


def _worker(ctx: Ctx) -> SettlementWorker:
    settings = ctx.settings
    coster = Coster(PriceTable.load(settings.prices), settings.unknown_model)
    # Without Redis the cache lives in the gateway, whose own worker heals it from the ledger
    # on its next pass (it picks up records settled by anyone).
    return SettlementWorker(
        ctx.ledger,
        ctx.store,
        coster,
        key_prefix=settings.key_prefix,
        batch_size=settings.settle_batch,
    )


async def cmd_settle(args: argparse.Namespace, ctx: Ctx) -> int:
    result = await _worker(ctx).run_once()
    data = {"settled": result.settled, "total_micros": result.total_micros}
    _emit(args, data, f"settled {result.settled} records (${_usd(result.total_micros)})")
    return 0


async def cmd_worker(args: argparse.Namespace, ctx: Ctx) -> int:
    interval = ctx.settings.settle_interval
    print(f"spendguard worker: settling every {interval}s (Ctrl-C stops)")
    await _worker(ctx).run(interval)
    return 0


async def _cached(ctx: Ctx, ident: Identity, scopes: list[dict[str, Any]]) -> Any:
    """Cached usage (settled + pending) of the policy-bearing scopes, when Redis is used."""
    if ctx.store is None:
        return None
    keys = {}
    for s in scopes:
        if s["limit_micros"] is None:
            continue
        key = Identity(ident.team_id, s["api_key"]).api_key if s["api_key"] else None
        scope = Scope.API_KEY if key else Scope.TEAM
        field = policy_field(scope, Period(s["period"]), key)
        name = f"{field}:{s['period_id']}"
        keys[name] = usage_key(ctx.settings.key_prefix, ident.team, field, s["period_id"])
    try:
        values = await ctx.store.read_usage(list(keys.values()))
    except StoreUnavailable as exc:
        return {"error": str(exc)}
    return {name: values[key] for name, key in keys.items()}


def _policy_json(
    team_id: str, api_key_id: str | None, period: Period, limit: int
) -> dict[str, Any]:
    return {
        "team": team_id,
        "api_key": api_key_id,
        "period": period.value,
        "limit_micros": limit,
        "limit_usd": _usd(limit),
    }


# -- wiring ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spendguard", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)

    db = sub.add_parser("db", help="database schema").add_subparsers(dest="db_cmd", required=True)
    db.add_parser("init", parents=[common], help="create the tables (idempotent)").set_defaults(
        handler=cmd_db_init
    )

    pol = sub.add_parser("policy", help="spend policies").add_subparsers(
        dest="policy_cmd", required=True
    )
    p_set = pol.add_parser("set", parents=[common], help="create or change a limit")
    p_rm = pol.add_parser("rm", parents=[common], help="remove a limit")
    for p in (p_set, p_rm):
        p.add_argument("--team", required=True)
        p.add_argument("--api-key", default=None)
        p.add_argument("--period", required=True, choices=[x.value for x in Period])
    p_set.add_argument("--limit-usd", required=True, help="e.g. 5.00; 0 blocks everything")
    p_set.set_defaults(handler=cmd_policy_set)
    p_rm.set_defaults(handler=cmd_policy_rm)
    p_ls = pol.add_parser("ls", parents=[common], help="list active limits")
    p_ls.add_argument("--team", default=None)
    p_ls.set_defaults(handler=cmd_policy_ls)

    use = sub.add_parser("usage", parents=[common], help="settled spend and limits of a team")
    use.add_argument("--team", required=True)
    use.add_argument("--api-key", default=None)
    use.set_defaults(handler=cmd_usage)

    bal = sub.add_parser("balance", help="prepaid credit").add_subparsers(
        dest="balance_cmd", required=True
    )
    b_top = bal.add_parser("topup", parents=[common], help="add credit to a team's account")
    b_top.add_argument("--team", required=True)
    b_top.add_argument("--usd", required=True, help="e.g. 100")
    b_top.set_defaults(handler=cmd_balance_topup)
    b_show = bal.add_parser("show", parents=[common], help="a team's balance")
    b_show.add_argument("--team", required=True)
    b_show.set_defaults(handler=cmd_balance_show)

    sub.add_parser("settle", parents=[common], help="run one settlement pass").set_defaults(
        handler=cmd_settle
    )
    sub.add_parser("worker", parents=[common], help="run settlement in a loop").set_defaults(
        handler=cmd_worker
    )
    return parser


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    ledger = Ledger(settings.database_url.get_secret_value())
    store = make_store(settings) if settings.redis_url is not None else None
    assert store is None or isinstance(store, RedisStore)
    await ledger.connect()
    try:
        await ledger.init_schema()
        handler: Handler = args.handler
        return await handler(args, Ctx(settings, ledger, store))
    finally:
        await ledger.disconnect()
        if store is not None:
            await store.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings()
        return anyio.run(_run, args, settings)
    except KeyboardInterrupt:
        return 0
    except ConfigurationError as exc:
        print(f"spendguard: {exc}", file=sys.stderr)
        return 2
    except SpendGuardError as exc:
        print(f"spendguard: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
