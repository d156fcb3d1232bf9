"""``spendguard``: policies, usage, settlement, schema and prices from the command line.

Reads the same ``SPENDGUARD_*`` settings as the middleware. Readable output by default,
``--json`` for scripts; the database and store a command uses are named on stderr. Exit codes:
0 ok, 1 not found / nothing to do / a failed doctor check, 2 usage or config error.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio

from .alerts import cli as alerts_cli
from .budgets import cli as budgets_cli
from .describe import ledger_description, store_description
from .doctor import DoctorContext, run_checks
from .engine.admin import Admin, BalanceReport
from .engine.budgets import recovery_gate
from .engine.costing import DEFAULT_ENTRY, Coster
from .engine.price_files import LITELLM, litellm_file
from .engine.price_refresh import shipped_document
from .engine.pricing import Price, PriceTable
from .engine.recovery import Recovery
from .engine.views import (
    RATE_FIELDS,
    balance_json,
    balance_report_json,
    model_lists_json,
    policies_json,
    policy_json,
    rate_values,
    rates_json,
    removed_json,
    top_json,
    usage_json,
)
from .engine.worker import SettlementWorker
from .errors import ConfigurationError, SpendGuardError
from .ledger import Ledger
from .ledger.reports import TOP_BY
from .limits import KeyCodec, Period, Policy
from .money import checked_amount, usd_text, usd_to_micros
from .settings import Settings, UnknownModel, load_settings
from .store import OwnerLog, Store, make_store


@dataclass(frozen=True, slots=True)
class Ctx:
    settings: Settings
    ledger: Ledger
    store: Store | None  # a shared store only: an embedded one lives inside the gateway
    admin: Admin
    codec: KeyCodec


Handler = Callable[[argparse.Namespace, Ctx], Awaitable[int]]


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _amount(flag: str, value: str, what: str, *, allow_zero: bool) -> Decimal:
    """A USD amount from the command line, checked against the one bound (exit 2 if not)."""
    try:
        amount = Decimal(value)
    except ArithmeticError as exc:
        raise ConfigurationError(f"{flag}: not a USD amount: {value!r}") from exc
    if not amount.is_finite():
        raise ConfigurationError(f"{flag}: not a finite USD amount: {value!r}")
    try:
        checked_amount(usd_to_micros(amount), what, allow_zero=allow_zero)
    except ValueError as exc:
        raise ConfigurationError(f"{flag}: {exc}") from exc
    return amount


# -- commands --------------------------------------------------------------------------------
async def cmd_db_init(args: argparse.Namespace, ctx: Ctx) -> int:
    _emit(args, {"ok": True}, "schema ready")
    return 0


async def _hint_new_team(ctx: Ctx, team: str) -> None:
    """On stderr, when a command is about to give ``team`` its first policy while the ledger
    knows other teams: a mistyped team would otherwise be a silent success that limits
    nobody. The teams spelled alike, or a few the ledger knows."""
    known = sorted({p.team_id for p in await ctx.admin.list_policies(None)})
    if not known or team in known or await ctx.admin.balance(team) is not None:
        return
    alike = difflib.get_close_matches(team, known, n=3)
    hint = f"did you mean {', '.join(alike)}?" if alike else f"teams with policies: {_few(known)}"
    print(
        f"spendguard: team {team!r} has no policy yet in {ledger_description(ctx.settings)}: "
        f"this makes it a new team ({hint})",
        file=sys.stderr,
    )


def _few(names: Sequence[str], shown: int = 5) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


async def cmd_policy_set(args: argparse.Namespace, ctx: Ctx) -> int:
    amount = _amount("--limit-usd", args.limit_usd, "a limit", allow_zero=True)
    await _hint_new_team(ctx, args.team)
    # A bad id or amount is a ValueError naming what is wrong: exit code 2.
    alert_at = args.alert_at
    policy = await ctx.admin.set_policy(
        args.team,
        args.api_key,
        window=args.period,
        limit_usd=amount,
        hard=args.mode == "hard",
        alert_at="" if alert_at == "none" else alert_at,
        fit=args.fit,
    )
    who = _who(policy.team_id, policy.api_key_id)
    window = policy.limit.window.value
    mode = ("hard, fits" if policy.fit else "hard") if policy.hard else "soft"
    text = f"policy set: {who} {window} limit ${usd_text(policy.amount)} ({mode}"
    text += f", alerts at {_alerts_text(policy)})"
    _emit(args, policy_json(policy), text)
    return 0


def _alerts_text(policy: Policy) -> str:
    if policy.alert_at is None:
        return "the default"
    return ",".join(f"{p}%" for p in policy.alert_at) or "none"


async def cmd_policy_rm(args: argparse.Namespace, ctx: Ctx) -> int:
    removed = await ctx.admin.remove_policy(args.team, args.api_key, window=args.period)
    _emit(args, removed_json(removed), "policy removed" if removed else "no such active policy")
    return 0 if removed else 1


async def cmd_policy_ls(args: argparse.Namespace, ctx: Ctx) -> int:
    rows = await ctx.admin.list_policies(args.team or None)
    data = policies_json(rows, args.team or None)
    lines = [f"{'TEAM':<20} {'API KEY':<20} {'PERIOD':<6} {'MODE':<4} {'LIMIT USD':>12} ALERTS"]
    lines += [
        f"{p.team_id:<20} {p.api_key_id or '-':<20} {p.limit.window.value:<6} "
        f"{'hard' if p.hard else 'soft':<4} {usd_text(p.amount):>12} {_alerts_text(p)}"
        for p in rows
    ]
    _emit(args, data, "\n".join(lines) if rows else "no policies")
    return 0


async def cmd_usage(args: argparse.Namespace, ctx: Ctx) -> int:
    report = await ctx.admin.usage(args.team, args.api_key)
    # The embedded store lives inside the gateway process: out of the CLI's reach, so each
    # limit's "cache" is null there and "used" is the settled spend.
    data = usage_json(report, args.api_key)
    day, month = Period.DAY.bucket(report.at), Period.MONTH.bucket(report.at)
    lines = [f"team {report.team_id}: day {day}, month {month}"]
    lines += [_usage_line(row) for row in data["limits"]]
    if report.cache_error is not None:
        lines.append(f"  cache not readable ({report.cache_error}): usage from the ledger alone")
    count = report.unsettled_records
    lines.append(
        f"  {_count(count, 'unsettled record')} (estimated ${usd_text(report.unsettled_estimate)})"
    )
    _emit(args, data, "\n".join(lines))
    known = (
        any(row.amount is not None for row in report.limits)
        or report.charges_total
        or count
        or await ctx.admin.balance(args.team) is not None
    )
    where = ledger_description(ctx.settings)
    if not known:
        print(
            f"spendguard: team {report.team_id!r} has no policy, no records and no balance "
            f"in {where}",
            file=sys.stderr,
        )
        return 1
    if args.api_key is not None and not any(r.api_key_id is not None for r in report.limits):
        # Only the team's own rows: nothing of that key (a typo shows here, not as a success).
        print(
            f"spendguard: key {args.api_key!r} of team {report.team_id!r} has no policy and no "
            f"spend this day or month in {where}",
            file=sys.stderr,
        )
        return 1
    return 0


async def cmd_top(args: argparse.Namespace, ctx: Ctx) -> int:
    report = await ctx.admin.top_spenders(args.by, Period(args.period), args.limit)
    data = top_json(report)
    lines = [f"top spenders by {report.by}, {report.period.value} {report.period_id}"]
    for row in data["spenders"]:
        if "end_user" in row:
            who = f"{row['team']} end user {row['end_user']}"
        elif "tag" in row:
            who = f"tag {row['tag']}"
        elif "customer" in row:
            who = f"customer {row['customer']}"
        else:
            who = row.get("model") or row["team"] + (
                f" key {row['api_key']}" if row["api_key"] else ""
            )
        line = f"  {who:<32} ${row['spent_usd']} in {_count(row['requests'], 'request')}"
        if row.get("limit_usd") is not None:
            line += f" of ${row['limit_usd']}, ${row['remaining_usd']} left"
        f = row.get("forecast")
        if f and f["runs_out_at"]:
            line += f"; runs out {f['runs_out_at']}"
        lines.append(line)
    if not data["spenders"]:
        lines.append("  no charged requests")
    _emit(args, data, "\n".join(lines))
    return 0


def _usage_line(row: dict[str, Any]) -> str:
    """One limit of ``usage``'s readable output: used, limit, what is left, when it resets."""
    who = "team" if row["scope"] == "team" else f"key {row['api_key']}"
    spent = f"used ${row['used_usd']}"
    if row["used_micros"] != row["settled_micros"]:
        spent += f" (settled ${row['settled_usd']})"
    if row["limit_usd"] is None:
        limit = ", no limit"
    else:
        limit = f" of ${row['limit_usd']}, ${row['remaining_usd']} left"
    line = f"  {who:<24} {row['period']:<6} {spent}{limit}; resets {row['resets_at']}"
    f = row.get("forecast")
    if f and f["rate_per_hour_micros"]:
        line += f"; at ${f['rate_per_hour_usd']}/h ${f['projected_usd']} by then"
        if row["limit_micros"] is not None and row["used_micros"] >= row["limit_micros"]:
            line += ", limit reached"
        elif f["runs_out_at"] is not None:
            line += f", runs out {f['runs_out_at']}"
    return line


def _count(n: int, noun: str) -> str:
    """``1 record``, ``2 records``, ``0 records``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _who(team_id: str, api_key_id: str | None) -> str:
    return f"team {team_id}" + (f" key {api_key_id}" if api_key_id else "")


async def cmd_balance_topup(args: argparse.Namespace, ctx: Ctx) -> int:
    amount = _amount("--usd", args.usd, "a top-up", allow_zero=False)
    account = await ctx.admin.topup(args.team, amount)
    data = balance_json(args.team, account)
    _emit(args, data, f"team {args.team}: balance ${data['balance_usd']}")
    return 0


async def cmd_models(args: argparse.Namespace, ctx: Ctx) -> int:
    if args.models_cmd == "ls":
        lists = await ctx.admin.list_models(args.team)
    else:
        lists = await ctx.admin.allow_models(
            args.team, args.api_key, args.models, allowed=args.models_cmd == "allow"
        )
    data = model_lists_json(args.team, lists)
    lines = [f"{key or '(team)'}: {', '.join(pats)}" for key, pats in lists.items()]
    _emit(args, data, "\n".join(lines) or "no model lists: every model is allowed")
    return 0


def _rates_text(value: dict[str, int | None]) -> str:
    return ", ".join(f"{name} {v}" for name, v in value.items() if v is not None)


async def cmd_rate(args: argparse.Namespace, ctx: Ctx) -> int:
    removed: str | None = None  # after rm: what was removed
    if args.rate_cmd == "set":
        given = (args.rpm, args.tpm, args.max_parallel)
        if all(v is None for v in given):
            raise ConfigurationError("give at least one of --rpm, --tpm, --max-parallel")
        await ctx.admin.set_rates(
            args.team, args.api_key, rpm=args.rpm, tpm=args.tpm, max_parallel=args.max_parallel
        )
    elif args.rate_cmd == "rm":
        before = (await ctx.admin.list_rates(args.team)).get(args.api_key)
        who = _who(args.team, args.api_key)
        if not await ctx.admin.remove_rates(args.team, args.api_key):
            data = rates_json(args.team, await ctx.admin.list_rates(args.team))
            _emit(args, data, f"{who} has no rates to remove")
            return 1
        removed = f"removed the rates of {who}"
        if before is not None:
            removed += f": {_rates_text(rate_values(before))}"
    data = rates_json(args.team, await ctx.admin.list_rates(args.team))
    lines = [
        f"{row['api_key'] or '(team)'}: {_rates_text({f: row[f] for f in RATE_FIELDS})}"
        for row in data["rates"]
    ]
    if removed is None:
        text = "\n".join(lines) or "no rates"
    else:  # what was removed, then what is left (if anything)
        text = "\n".join([removed] + (["rates left:"] + [f"  {x}" for x in lines] if lines else []))
    _emit(args, data, text)
    return 0


async def cmd_balance_mode(args: argparse.Namespace, ctx: Ctx) -> int:
    account = await ctx.admin.set_balance_mode(args.team, hard=args.mode == "hard")
    _emit(args, balance_json(args.team, account), f"team {args.team}: {args.mode} balance")
    return 0


async def cmd_balance_show(args: argparse.Namespace, ctx: Ctx) -> int:
    report: BalanceReport | None = await ctx.admin.balance(args.team)
    if report is None:
        _emit(args, {"team": args.team, "account": None}, "no balance account (unlimited)")
        return 1
    account = report.account
    data = balance_report_json(report)
    left = ""
    if report.remaining != account.balance:  # the cache knows of usage not settled yet
        left = f", ${data['remaining_usd']} left counting it"
    _emit(
        args,
        data,
        f"team {args.team}: {data['mode']} balance ${data['balance_usd']} (topped up "
        f"${data['topped_up_usd']}, charged ${data['charged_usd']}; "
        f"{_count(report.unsettled_records, 'record')} unsettled, "
        f"estimated ${data['unsettled_estimate_usd']}{left})",
    )
    return 0


def _worker(ctx: Ctx) -> SettlementWorker:
    settings = ctx.settings
    coster = Coster(PriceTable.load(settings.prices), settings.unknown_model)
    # Without Redis the cache lives in the gateway, whose own worker heals it from the ledger
    # on its next pass (it picks up records settled by anyone).
    store = ctx.store
    recovery = None
    if store is not None and store.shared and isinstance(store, OwnerLog):
        # A standalone worker also writes the records of gateways that died (their entries).
        # Its budgets' holds become what the recovered records are charged.
        gate = recovery_gate(settings, coster.table, ctx.ledger, store)
        holds = gate.recover if gate is not None else None
        recovery = Recovery(ctx.ledger, store, store, ctx.codec, coster, me="", holds=holds)
    return SettlementWorker(
        ctx.ledger,
        store,
        coster,
        ctx.codec,
        batch_size=settings.settle_batch,
        recovery=recovery,
    )


async def cmd_settle(args: argparse.Namespace, ctx: Ctx) -> int:
    result = await _worker(ctx).run_once()
    data = {"settled": result.settled, "total_micros": result.total_micros}
    total = usd_text(result.total_micros)
    _emit(args, data, f"settled {_count(result.settled, 'record')} (${total})")
    return 0


async def cmd_worker(args: argparse.Namespace, ctx: Ctx) -> int:
    interval = ctx.settings.settle_interval
    print(f"spendguard worker: settling every {interval}s (Ctrl-C stops)")
    await _worker(ctx).run(interval)
    return 0


async def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    findings = await run_checks(DoctorContext(settings, app=args.app, gateway=args.gateway))
    if args.json:
        data = {f.check: {"ok": f.ok, "detail": f.detail, **f.data} for f in findings}
        print(json.dumps(data, indent=2))
    else:
        for f in findings:
            print(f"{'ok ' if f.ok else 'BAD'} {f.check:<9} {f.detail}")
            if f.check == "settings":
                for name, value in f.data.items():
                    print(f"      {name} = {value}")
    return 0 if all(f.ok for f in findings) else 1


def cmd_prices_show(args: argparse.Namespace, settings: Settings) -> int:
    """Which price a model name gets and by which rule, or the unknown-model rule (no
    database). Exit 0 when the table prices the name, 1 when it is unknown."""
    table = PriceTable.load(settings.prices)
    found = table.match(args.model)
    rule = settings.unknown_model
    data: dict[str, Any] = {
        "model": args.model,
        "match": None,
        "rule": None,
        "via": None,
        "from_file": False,
        "provider": None,
        "price": None,
        "max_output_tokens": None,
        "unknown_model": rule.value,
        "ambiguous": list(table.ambiguous(args.model)),
        "as_of": table.as_of,
        "file_as_of": table.user_as_of,
    }
    if found is not None:
        origin = "your price file" if found.from_file else f"shipped table as of {table.as_of}"
        who = f"{found.provider}; " if found.provider else ""
        how = found.how.value + (f" {found.via}" if found.via else "")
        data |= {
            "match": found.entry,
            "rule": found.how.name.lower(),
            "via": found.via,
            "from_file": found.from_file,
            "provider": found.provider,
            "max_output_tokens": found.max_output_tokens,
        }
        data["price"] = _price_json(found.price)
        head = f"{args.model}: priced as {found.entry} by {how} ({who}{origin})"
        lines = [head, *_price_lines(found.price)]
        if found.max_output_tokens is not None:
            lines.append(f"  {'max output':<13} {found.max_output_tokens:,} tokens")
        _emit(args, data, "\n".join(lines))
        return 0
    why = "not in the price table"
    if data["ambiguous"]:
        why = f"ambiguous: priced differently by {', '.join(data['ambiguous'])}"
    fallback = table.lookup(DEFAULT_ENTRY) if rule is UnknownModel.DEFAULT_PRICE else None
    if fallback is not None:
        data |= {"match": DEFAULT_ENTRY, "rule": "unknown", "price": _price_json(fallback)}
        head = f"{args.model}: unknown ({why}); charged the {DEFAULT_ENTRY} price"
        _emit(args, data, "\n".join([head, *_price_lines(fallback)]))
    elif rule is UnknownModel.REJECT:
        data["rule"] = "unknown"
        _emit(args, data, f"{args.model}: unknown ({why}); refused with a 400")
    else:
        data["rule"] = "unknown"
        _emit(args, data, f"{args.model}: unknown ({why}); charged nothing")
    return 1


def cmd_prices_refresh(args: argparse.Namespace, settings: Settings) -> int:
    """Write the shipped price table made from a LiteLLM price file (maintainers: see
    :mod:`spendguard.engine.price_refresh`)."""
    source = litellm_file() if args.source == LITELLM else Path(args.source)
    version = args.source_version
    if version is None and args.source == LITELLM:
        version = importlib.metadata.version(LITELLM)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{source}: cannot read a LiteLLM price file: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigurationError(f"{source}: not a LiteLLM price file")
    as_of = args.as_of or datetime.now(UTC).date().isoformat()
    document, left_out = shipped_document(data, as_of=as_of, version=version or "unknown")
    text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
    print(
        f"{len(document['models'])} models from {source} (LiteLLM {version or 'unknown'}); "
        f"{len(left_out)} left out as ambiguous" + (f": {', '.join(left_out)}" if left_out else ""),
        file=sys.stderr,
    )
    return 0


_PRICE_LABELS = {
    "input": "input",
    "output": "output",
    "cached_input": "cached input",
    "cache_write": "cache write",
}


def _price_json(price: Price) -> dict[str, str]:
    # Exact decimals as strings: "0.15", never 0.15000000 or a binary float.
    return {field: _plain(getattr(price, field)) for field in _PRICE_LABELS}


def _price_lines(price: Price) -> list[str]:
    return [
        f"  {label:<13} ${_plain(getattr(price, field))} per 1M tokens"
        for field, label in _PRICE_LABELS.items()
    ]


def _plain(amount: Decimal) -> str:
    # Exact, with no exponent and at least cents: 0.60, 0.075, 15.00.
    value = amount.normalize()
    if int(value.as_tuple().exponent) > -2:
        value = value.quantize(Decimal("0.01"))
    return format(value, "f")


# -- wiring ----------------------------------------------------------------------------------
def _version() -> str:
    try:
        return importlib.metadata.version("spendguard")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare checkout
        from . import __version__

        return __version__


# Plain text: --help prints it as it is (the module docstring is reST).
DESCRIPTION = "policies, usage, settlement, schema and prices from the command line."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spendguard", description=f"spendguard: {DESCRIPTION}")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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
    p_set.add_argument(
        "--mode",
        choices=("soft", "hard"),
        default="soft",
        help="soft (default): admitted while usage is below the limit; hard: admitted only "
        "if the request's worst-case cost fits, held until it ends",
    )
    p_set.add_argument(
        "--fit",
        action="store_true",
        help="with --mode hard: a request whose max_tokens doesn't fit is fitted to what is "
        "left instead of refused (needs SPENDGUARD_FIT_MIN_OUTPUT_TOKENS on the gateway)",
    )
    p_set.add_argument(
        "--alert-at",
        default=None,
        metavar="PCTS",
        help="the limit's own alert thresholds, e.g. 50,80,100; 'none': never alerts; "
        "'default': SPENDGUARD_ALERT_THRESHOLDS (unset: a limit keeps what it has)",
    )
    p_set.set_defaults(handler=cmd_policy_set)
    p_rm.set_defaults(handler=cmd_policy_rm)
    p_ls = pol.add_parser("ls", parents=[common], help="list active limits")
    p_ls.add_argument("--team", default=None)
    p_ls.set_defaults(handler=cmd_policy_ls)

    use = sub.add_parser("usage", parents=[common], help="settled spend and limits of a team")
    use.add_argument("--team", required=True)
    use.add_argument("--api-key", default=None)
    use.set_defaults(handler=cmd_usage)
    top = sub.add_parser("top", parents=[common], help="who spends most this day or month")
    top.add_argument("--by", choices=TOP_BY, default="team")
    top.add_argument("--period", choices=[x.value for x in Period], default="day")
    top.add_argument("--limit", type=int, default=10, help="how many (1 to 1000)")
    top.set_defaults(handler=cmd_top)

    mod = sub.add_parser("models", help="which models a key or team may call").add_subparsers(
        dest="models_cmd", required=True
    )
    for name, text in (("allow", "allow models (names or globs)"), ("rm", "stop allowing")):
        m = mod.add_parser(name, parents=[common], help=text)
        m.add_argument("--team", required=True)
        m.add_argument("--api-key", default=None, help="a key's list (default: the team's)")
        m.add_argument("models", nargs="+", metavar="MODEL", help="e.g. gpt-4o-mini 'claude-*'")
        m.set_defaults(handler=cmd_models)
    m_ls = mod.add_parser("ls", parents=[common], help="a team's model lists")
    m_ls.add_argument("--team", required=True)
    m_ls.set_defaults(handler=cmd_models)

    rate = sub.add_parser("rate", help="requests and tokens per minute, requests in flight")
    rate_sub = rate.add_subparsers(dest="rate_cmd", required=True)
    r_set = rate_sub.add_parser(
        "set", parents=[common], help="set rates (a rate not given is kept; 0 removes it)"
    )
    for name, text in (
        ("rm", "remove every rate of a key (or the team)"),
        ("ls", "a team's rates"),
    ):
        rate_sub.add_parser(name, parents=[common], help=text)
    for cmd, r in rate_sub.choices.items():
        r.add_argument("--team", required=True)
        if cmd != "ls":
            r.add_argument("--api-key", default=None, help="a key's rates (default: the team's)")
        r.set_defaults(handler=cmd_rate)
    for flag, text in (
        ("--rpm", "requests per minute"),
        ("--tpm", "tokens per minute (prompt estimate + output cap reserved at admission)"),
        ("--max-parallel", "requests in flight at once"),
    ):
        r_set.add_argument(flag, type=int, default=None, metavar="N", help=text)

    bal = sub.add_parser("balance", help="prepaid credit").add_subparsers(
        dest="balance_cmd", required=True
    )
    b_top = bal.add_parser("topup", parents=[common], help="add credit to a team's account")
    b_top.add_argument("--team", required=True)
    b_top.add_argument("--usd", required=True, help="e.g. 100")
    b_top.set_defaults(handler=cmd_balance_topup)
    b_mode = bal.add_parser("mode", parents=[common], help="make a team's balance hard or soft")
    b_mode.add_argument("--team", required=True)
    b_mode.add_argument("--mode", required=True, choices=("soft", "hard"))
    b_mode.set_defaults(handler=cmd_balance_mode)
    b_show = bal.add_parser("show", parents=[common], help="a team's balance")
    b_show.add_argument("--team", required=True)
    b_show.set_defaults(handler=cmd_balance_show)

    prices = sub.add_parser("prices", help="the price table").add_subparsers(
        dest="prices_cmd", required=True
    )
    pr_show = prices.add_parser(
        "show", parents=[common], help="which entry and price a model name gets"
    )
    pr_show.add_argument("model", help="a model name as clients send it, e.g. openai/gpt-4o")
    pr_show.set_defaults(offline=cmd_prices_show)
    pr_refresh = prices.add_parser(
        "refresh", parents=[common], help="make the shipped price table from LiteLLM's file"
    )
    pr_refresh.add_argument(
        "--from",
        dest="source",
        default=LITELLM,
        help="LiteLLM's model_prices_and_context_window.json (default: the installed litellm's)",
    )
    pr_refresh.add_argument("--source-version", default=None, help="the LiteLLM release it is of")
    pr_refresh.add_argument("--as-of", default=None, help="the table's date (default: today)")
    pr_refresh.add_argument("--out", default=None, help="file to write (default: stdout)")
    pr_refresh.set_defaults(offline=cmd_prices_refresh)

    sub.add_parser("settle", parents=[common], help="run one settlement pass").set_defaults(
        handler=cmd_settle
    )
    sub.add_parser("worker", parents=[common], help="run settlement in a loop").set_defaults(
        handler=cmd_worker
    )
    doc = sub.add_parser(
        "doctor", parents=[common], help="settings, database, store, routes (and a gateway)"
    )
    doc.add_argument(
        "--app", default=None, help="the gateway app as module:attribute, to check its routes"
    )
    doc.add_argument(
        "--gateway",
        default=None,
        metavar="URL",
        help="a running gateway's admin routes (e.g. http://127.0.0.1:8000/admin/spendguard), "
        "read with SPENDGUARD_ADMIN_TOKEN: its lifespan, writer, worker and store",
    )
    doc.set_defaults(handler=None, opens_its_own=cmd_doctor)
    budgets_cli.add_commands(sub, common)
    alerts_cli.add_commands(sub, common)
    return parser


async def cmd_budgets(args: argparse.Namespace, ctx: Ctx) -> int:
    return await budgets_cli.run(args, ctx.settings, ctx.ledger)


async def cmd_alerts(args: argparse.Namespace, ctx: Ctx) -> int:
    service = alerts_cli.service_for(ctx.settings, ctx.ledger, ctx.store, ctx.codec)
    return await alerts_cli.run(args, service)


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    opens_its_own = getattr(args, "opens_its_own", None)  # doctor: never creates a database
    if opens_its_own is not None:
        code: int = await opens_its_own(args, settings)
        return code
    # Named before anything is opened: a relative path or a missing file shows here.
    print(
        f"spendguard: database {ledger_description(settings)}; store {store_description(settings)}",
        file=sys.stderr,
    )
    ledger = Ledger(settings.database_url.get_secret_value())
    store: Store | None = make_store(settings)
    if store is not None and not store.shared:
        # The embedded store lives inside the gateway: out of the CLI's reach.
        await store.aclose()
        store = None
    codec = KeyCodec(settings.key_prefix, timedelta(seconds=settings.key_grace))
    admin = Admin(ledger, store, codec, policy_ttl=settings.policy_ttl)
    await ledger.connect()
    try:
        await ledger.init_schema()
        handler: Handler = args.handler
        return await handler(args, Ctx(settings, ledger, store, admin, codec))
    finally:
        await ledger.disconnect()
        if store is not None:
            await store.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "standalone", None) is not None:  # needs no settings (budgets validate)
        code: int = args.standalone(args)
        return code
    if getattr(args, "budgets_cmd", None) is not None:
        args.handler = cmd_budgets
    if getattr(args, "alerts_cmd", None) is not None:
        args.handler = cmd_alerts
    try:
        settings = load_settings()
        offline: Callable[[argparse.Namespace, Settings], int] | None = getattr(
            args, "offline", None
        )
        if offline is not None:  # needs neither the database nor the store
            return offline(args, settings)
        return anyio.run(_run, args, settings)
    except KeyboardInterrupt:
        return 0
    except (ConfigurationError, ValueError) as exc:  # bad input (an empty id, say)
        print(f"spendguard: {exc}", file=sys.stderr)
        return 2
    except SpendGuardError as exc:
        print(f"spendguard: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug, not bad input: one line for the user, details logged
        logging.getLogger("spendguard").debug("spendguard CLI failed", exc_info=True)
        print(f"spendguard: unexpected error: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
