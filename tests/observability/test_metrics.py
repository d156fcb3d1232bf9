"""The request-path metrics, driven by real traffic through the middleware (the embedded store
and a private redis-server), read from the process-wide registry as deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import REGISTRY

from spendguard.clock import utcnow
from spendguard.engine.recorder import Recorder
from spendguard.errors import StoreUnavailable
from spendguard.ledger import Ledger
from spendguard.limits import Period
from spendguard.store.redis import RedisStore
from tests.support import Gateway, chat_body
from tests.support.records import make_record

pytestmark = pytest.mark.anyio


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Deltas:
    """Sample values now, and how far each moved since."""

    def __init__(self, *samples: tuple[str, dict[str, str]]) -> None:
        self.samples = samples
        self.before = [value(name, **labels) for name, labels in samples]

    def __call__(self) -> list[float]:
        return [
            value(name, **labels) - before
            for (name, labels), before in zip(self.samples, self.before, strict=True)
        ]


def decisions(outcome: str, kind: str, period: str = "none") -> tuple[str, dict[str, str]]:
    return "spendguard_decisions_total", {"outcome": outcome, "kind": kind, "period": period}


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_gateway(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Gateways on the parametrized store (Redis: the session's private server, emptied)."""

    @asynccontextmanager
    async def make(**settings: Any) -> AsyncIterator[Gateway]:
        store = None
        if store_kind == "redis":
            store = RedisStore.from_url(request.getfixturevalue("redis_url"), timeout=1.0)
        try:
            async with Gateway(tmp_path, utcnow, store=store, **settings) as gw:
                yield gw
        finally:
            if store is not None:
                await store.aclose()

    yield make


async def test_traffic_counts_decisions_spend_tokens_and_store_latency(make_gateway: Any) -> None:
    async with make_gateway() as gw:
        # A soft 20 micro-USD daily limit on the key; each request costs 10 + 5 = 15.
        await gw.policy(Period.DAY, 20)
        calls = dict(gw.store.calls)
        deltas = Deltas(
            decisions("allowed", "limited"),
            decisions("denied", "api_key", "day"),
            decisions("denied", "team", "day"),
            ("spendguard_spend_micros_total", {}),
            ("spendguard_tokens_total", {"type": "input"}),
            ("spendguard_tokens_total", {"type": "output"}),
            ("spendguard_store_seconds_count", {"call": "preflight"}),
            ("spendguard_store_seconds_count", {"call": "postflight"}),
        )
        statuses = [(await gw.post(x_in=10, x_out=5)).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        allowed, denied_key, denied_team, spend, tokens_in, tokens_out, pre, post = deltas()
        assert (allowed, denied_key, denied_team) == (2, 1, 0)
        assert spend == 30  # exactly what postflight charged the two served requests
        assert (tokens_in, tokens_out) == (20, 10)
        # One observation per store call: a cache miss adds a preflight round.
        assert pre == gw.store.calls["preflight"] - calls.get("preflight", 0) >= 3
        assert post == gw.store.calls["postflight"] - calls.get("postflight", 0) == 2


async def test_a_team_limit_denial_and_an_unlimited_allow_are_told_apart(
    make_gateway: Any,
) -> None:
    async with make_gateway() as gw:
        deltas = Deltas(decisions("allowed", "unlimited"), decisions("denied", "team", "month"))
        assert (await gw.post()).status_code == 200  # no policy: not limited
        await gw.policy(Period.MONTH, 0, key=None)
        assert (await gw.post()).status_code == 429
        assert deltas() == [1, 1]


async def test_admission_decisions_model_list_and_errors_are_counted(make_gateway: Any) -> None:
    async with make_gateway(unknown_model="reject") as gw:
        deltas = Deltas(
            decisions("denied", "unpriced"),
            decisions("denied", "identity"),
            decisions("denied", "model"),
            decisions("error", "store"),
            ("spendguard_spend_micros_total", {}),
        )
        assert (await gw.post(model="no-such-model")).status_code == 400
        gw.app.team = None  # the host's auth found no identity
        assert (await gw.post()).status_code == 401
        gw.app.team = "acme"
        await gw.guard.admin.allow_models("acme", None, ["gpt-*"])
        assert (await gw.post()).status_code == 403

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable("down")

        gw.store.inner.preflight = down
        assert (await gw.post()).status_code == 503
        assert deltas() == [1, 1, 1, 1, 0]


async def test_a_rate_denial_is_counted_as_kind_rate(make_gateway: Any) -> None:
    async with make_gateway() as gw:
        await gw.guard.admin.set_rates("acme", "alpha", rpm=1)
        deltas = Deltas(decisions("denied", "rate"), decisions("error", "store"))
        assert (await gw.post()).status_code == 200
        assert (await gw.post()).status_code == 429
        assert deltas() == [1, 0]


async def test_a_release_is_timed_and_charges_nothing(make_gateway: Any) -> None:
    async with make_gateway() as gw:
        await gw.guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1, hard=True)
        deltas = Deltas(
            ("spendguard_store_seconds_count", {"call": "release"}),
            ("spendguard_spend_micros_total", {}),
        )
        assert (await gw.post(x_status=500)).status_code == 500  # upstream error: uncharged
        assert deltas() == [1, 0]


async def test_records_written_and_default_priced_charges(make_gateway: Any) -> None:
    async with make_gateway() as gw:
        deltas = Deltas(
            ("spendguard_records_written_total", {}),
            ("spendguard_default_priced_total", {"stage": "estimate"}),
            ("spendguard_default_priced_total", {"stage": "settlement"}),
            ("spendguard_spend_micros_total", {}),
        )
        assert (await gw.post()).status_code == 200
        assert (await gw.post(model="not-in-the-table", x_in=7, x_out=3)).status_code == 200
        await gw.settle()
        # The unit table's default entry is 1 micro-USD per token as well. Settlement charges
        # the price the record carries: it asks the table for no default price.
        assert deltas() == [2, 1, 0, 25]


async def test_records_pending_counts_what_the_ledger_does_not_have_yet(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    await ledger.connect()
    await ledger.init_schema()
    try:
        recorder = Recorder(ledger, capacity=10)
        before = value("spendguard_records_pending")
        written = value("spendguard_records_written_total")
        for i in range(3):
            recorder.submit(make_record(f"r{i}", utcnow(), 10))
        assert value("spendguard_records_pending") - before == 3
        await recorder.flush()
        assert value("spendguard_records_pending") - before == 0
        assert value("spendguard_records_written_total") - written == 3
    finally:
        await ledger.disconnect()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'overspend.db'}"
    return str(request.getfixturevalue("clean_postgres_url"))


def overspend(kind: str, period: str) -> tuple[str, dict[str, str]]:
    return "spendguard_overspend_micros_total", {"kind": kind, "period": period}


async def test_settlement_counts_the_overspend_of_a_soft_cap_burst_once(
    make_gateway: Any, ledger_url: str
) -> None:
    async with make_gateway(database_url=ledger_url) as gw:
        await gw.policy(Period.DAY, 20)  # soft: admitted while usage is below 20
        await gw.policy(Period.MONTH, 10**9, key=None)  # far from its limit
        assert (await gw.post(x_in=0, x_out=1)).status_code == 200  # warm: policy cached
        deltas = Deltas(
            overspend("api_key", "day"), overspend("team", "month"), overspend("team", "day")
        )
        statuses: list[int] = []
        async with gw.client() as c:

            async def one() -> None:
                r = await c.post("/v1/chat/completions", json=chat_body(x_in=10, x_out=5))
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one)
        allowed = statuses.count(200)
        assert allowed >= 2 and statuses.count(429) == 8 - allowed  # 1, then 16 < 20 admit
        await gw.settle()
        beyond = 1 + 15 * allowed - 20  # settled against a limit of 20
        assert deltas() == [beyond, 0, 0]
        # A later batch counts only what it adds beyond the limit, and only once.
        await gw.policy(Period.DAY, 1 + 15 * allowed + 5)
        assert (await gw.post(x_in=10, x_out=5)).status_code == 200
        await gw.settle()
        await gw.settle()  # nothing new to settle: nothing counted again
        assert deltas() == [beyond + 10, 0, 0]  # 15 more, 5 of them under the new limit


async def test_a_used_up_balance_denies_and_settlement_counts_its_overdraft(
    make_gateway: Any, ledger_url: str
) -> None:
    async with make_gateway(database_url=ledger_url) as gw:
        await gw.guard.admin.topup("acme", "0.00002")  # 20 micro-USD, soft
        deltas = Deltas(
            decisions("allowed", "limited"),
            decisions("denied", "balance"),
            overspend("balance", "none"),
        )
        statuses = [(await gw.post(x_in=10, x_out=5)).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        await gw.settle()
        assert deltas() == [2, 1, 10]  # 30 charged against 20 topped up


def test_a_denial_by_a_target_kind_the_mapping_does_not_know_is_counted_not_raised() -> None:
    from spendguard.engine.decision import Verdict
    from spendguard.engine.telemetry import decided

    deltas = Deltas(decisions("denied", "other"))
    decided(Verdict.DENY, True, object(), False, None)  # type: ignore[arg-type]
    assert deltas() == [1]


def test_every_counter_is_exported_at_zero_from_the_first_scrape() -> None:
    """A fresh process, nothing happened yet: every counter with closed labels already has
    its series (at 0), so a panel shows 0 and increase() counts the first event."""
    import subprocess
    import sys

    from spendguard.engine.costing import Stage
    from spendguard.metrics import PRICE_RULES, PRICE_STAGES
    from spendguard.settings import UnknownModel

    assert set(PRICE_RULES) == {r.value for r in UnknownModel}
    assert set(PRICE_STAGES) == {s.value for s in Stage}
    scrape = subprocess.run(
        [
            sys.executable,
            "-c",
            "import spendguard; from prometheus_client import generate_latest; "
            "print(generate_latest().decode())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counters = [
        line.split()[2].removesuffix("_total")
        for line in scrape.splitlines()
        if line.startswith("# TYPE spendguard_") and line.endswith(" counter")
    ]
    # The budgets' series carry the operator's window ids: they start with the budgets file.
    per_window = {"spendguard_budget_used", "spendguard_budget_rejections"}
    assert len(counters) > 10
    missing = [
        name
        for name in counters
        if name not in per_window
        and not any(line.startswith(f"{name}_total") for line in scrape.splitlines())
    ]
    assert missing == []
    assert 'spendguard_alert_deliveries_total{result="failed"} 0.0' in scrape
    assert 'spendguard_store_unavailable_total{action="allow"} 0.0' in scrape
