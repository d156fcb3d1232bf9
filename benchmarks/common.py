"""What every measurement shares: the run's services, its sizes, and the gateway setup."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spendguard import Identity
from spendguard.asgi.middleware import SpendGuardMiddleware
from spendguard.engine.guard import SpendGuard
from spendguard.ledger import Ledger
from spendguard.limits import Period, Policy, key_limit, team_limit

from .apps import KEY_ID, TEAM_ID

# Limits high enough that no benchmark request is ever refused: the limit is checked (policies
# exist, usage keys are read and charged) but never reached.
HIGH_LIMIT_MICROS = 10**15


@dataclass(frozen=True, slots=True)
class Services:
    redis_url: str
    postgres_url: str
    workdir: Path  # private scratch dir of this run (SQLite files, logs)

    @property
    def sqlite_url(self) -> str:
        return f"sqlite:///{self.workdir / 'embedded.db'}"


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each measurement does; ``--quick`` shrinks all of it."""

    inproc_inference: int  # timed requests per variant per repeat
    inproc_health: int
    inproc_block: int  # requests of one variant in a row before the next variant's turn
    inproc_warmup: int
    http_seconds: float  # one load run
    http_health_seconds: float
    http_pause: float  # between runs: the previous server finishes its background writes
    http_warmup: float  # per server and route, before the first measured run
    http_concurrency: tuple[int, ...]
    overshoot_n: tuple[int, ...]
    settle_records: int  # at least; a batch size above it settles one full batch
    settle_teams: int  # x 5 keys, every one with a daily key and a monthly team limit
    settle_batches: tuple[int, ...]
    settle_workers: tuple[int, ...]  # worker processes racing on one PostgreSQL ledger
    settle_race_records: int  # records they settle together, in batches of settle_race_batch
    settle_race_batch: int
    preflight_calls: int  # per concurrency level
    preflight_concurrency: tuple[int, ...]
    client_calls: int  # Redis client-path experiment, calls per client
    route_calls: int  # RouteTable.match and the safety net's steps: calls per timed batch
    route_batches: int  # timed batches of each, per repeat

    @classmethod
    def full(cls) -> Sizes:
        return cls(
            inproc_inference=1000,
            inproc_health=3000,
            inproc_block=50,
            inproc_warmup=300,
            http_seconds=2.0,
            http_health_seconds=1.0,
            http_pause=0.2,
            http_warmup=0.4,
            http_concurrency=(1, 16, 64),
            overshoot_n=(10, 100, 500),
            settle_records=1000,
            settle_teams=20,
            settle_batches=(100, 1000, 5000),
            settle_workers=(1, 2, 4),
            settle_race_records=40_000,
            settle_race_batch=1000,
            preflight_calls=4000,
            preflight_concurrency=(1, 64),
            client_calls=4000,
            route_calls=10_000,
            route_batches=15,
        )

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            inproc_inference=100,
            inproc_health=200,
            inproc_block=20,
            inproc_warmup=30,
            http_seconds=0.2,
            http_health_seconds=0.2,
            http_pause=0.0,
            http_warmup=0.0,
            http_concurrency=(1, 16, 64),
            overshoot_n=(5, 20, 50),
            settle_records=300,
            settle_teams=4,
            settle_batches=(100, 1000),
            settle_workers=(1, 2),
            settle_race_records=600,
            settle_race_batch=100,
            preflight_calls=200,
            preflight_concurrency=(1, 64),
            client_calls=200,
            route_calls=200,
            route_batches=3,
        )


def bench_identity() -> Identity:
    return Identity(TEAM_ID, KEY_ID)


async def set_policies(
    database_url: str,
    identity: Identity,
    *,
    key_day: int = HIGH_LIMIT_MICROS,
    team_month: int | None = HIGH_LIMIT_MICROS,
    now: datetime | None = None,
    hard: bool = False,
) -> None:
    """The limits a real deployment has: the key per day and the team per month."""
    ledger = Ledger(database_url)
    await ledger.connect()
    try:
        await ledger.init_schema()
        now = now or datetime.now(UTC)
        day = Policy(
            key_limit(identity, Period.DAY),
            key_day,
            identity.team_id,
            identity.api_key_id,
            hard=hard,
        )
        await ledger.set_policy(day, now=now)
        if team_month is not None:
            month = Policy(team_limit(identity, Period.MONTH), team_month, identity.team_id)
            await ledger.set_policy(month, now=now)
    finally:
        await ledger.disconnect()


def find_guard(app: Any) -> SpendGuard | None:
    """The SpendGuard inside a built Starlette app's middleware stack, if any."""
    node: Any = getattr(app, "middleware_stack", None) or app
    for _ in range(50):
        if isinstance(node, SpendGuardMiddleware):
            return node.guard
        node = getattr(node, "app", None)
        if node is None:
            return None
    return None


def section_args(prog: str, numbers: dict[str, str] | None = None, **flags: str) -> Any:
    """The options of a section run alone (``python -m benchmarks.<section>``): ``--quick``,
    ``--repeat N`` and ``--postgres-url`` (default: ``SPENDGUARD_TEST_POSTGRES_URL`` or the
    local server as user postgres), and the section's own on/off ``flags`` and whole-number
    options ``numbers`` (name: help; absent: None)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--quick", action="store_true")
    for name, text in flags.items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    for name, text in (numbers or {}).items():
        parser.add_argument(f"--{name}", type=int, help=text)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "SPENDGUARD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    return parser.parse_args()
