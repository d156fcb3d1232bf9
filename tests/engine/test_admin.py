"""The admin API: changes land in the ledger and reach the cache at once, reports add up."""

from __future__ import annotations

import importlib
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import anyio
import httpx
import pytest

from spendguard import Settings, SpendGuard
from spendguard.clock import utcnow
from spendguard.identity import Identity
from spendguard.limits import Period, Policy, key_limit, team_limit
from spendguard.money import MAX_TOTAL_MICROS
from spendguard.store.redis import RedisStore
from tests.support import Gateway, chat_body, lifespan

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")


async def post(gw: Gateway) -> int:
    async with gw.client() as c:
        return (await c.post("/v1/chat/completions", json=chat_body())).status_code


async def test_a_change_applies_to_the_next_request_without_a_settlement_pass(
    tmp_path: Path,
) -> None:
    async with Gateway(tmp_path) as gw:
        admin = gw.guard.admin
        assert await post(gw) == 200  # no limit; "no policy" is now cached
        await admin.set_policy("acme", "alpha", window="day", limit_usd=0)
        assert await post(gw) == 429  # the cached "no policy" was dropped by the change
        assert await admin.remove_policy("acme", "alpha", window=Period.DAY)
        assert not await admin.remove_policy("acme", "alpha", window=Period.DAY)
        assert await post(gw) == 200
        assert [p.limit for p in await admin.list_policies("acme")] == []


async def test_usage_report_has_limit_remaining_and_reset(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:  # the clock reads 2026-09-30 12:00 UTC
        admin = gw.guard.admin
        await admin.set_policy("acme", "alpha", window="day", limit_usd=Decimal("0.000100"))
        await admin.set_policy("acme", window="month", limit_usd="1")
        for _ in range(2):
            assert await post(gw) == 200  # 15 micro-USD each (unit prices)
        await gw.guard.recorder.flush()  # the records reach the ledger (the writer batches)
        report = await admin.usage("acme")
        rows = {(u.limit, u.bucket): u for u in report.limits}
        day = rows[(key_limit(ALPHA, Period.DAY), "20260930")]
        assert (day.amount, day.settled, day.cached, day.remaining) == (100, 0, 30, 70)
        assert day.resets_at == datetime(2026, 10, 1, tzinfo=UTC)
        assert day.api_key_id == "alpha"
        month = rows[(team_limit(ALPHA, Period.MONTH), "202609")]
        assert (month.amount, month.remaining) == (1_000_000, 1_000_000 - 30)
        assert month.resets_at == datetime(2026, 10, 1, tzinfo=UTC)
        assert report.unsettled_records == 2 and report.unsettled_estimate == 30
        await gw.settle()
        settled = {(u.limit, u.bucket): u for u in (await admin.usage("acme")).limits}
        day = settled[(key_limit(ALPHA, Period.DAY), "20260930")]
        assert (day.settled, day.aggregate, day.cached, day.remaining) == (30, 30, 30, 70)
        assert (await admin.usage("acme")).charges_total == 30


async def test_topup_and_balance_report(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        admin = gw.guard.admin
        assert await admin.balance("acme") is None
        account = await admin.topup("acme", "0.000020")
        assert (account.topped_up, account.charged, account.balance) == (20, 0, 20)
        assert await post(gw) == 200  # 15 of 20
        report = await admin.balance("acme")
        assert report is not None and report.cached_used == 15 and report.remaining == 5
        assert await post(gw) == 200  # admitted at 5 left (a soft cap), now -10
        assert await post(gw) == 429
        await admin.topup("acme", "0.000100")
        assert await post(gw) == 200  # the top-up reached the cache at once


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": "week", "limit_usd": 1}, "week"),
        ({"window": "day", "limit_usd": "-1"}, "at least 0"),
        ({"window": "day", "limit_usd": "1000000000.000001"}, "at most 1,000,000,000 USD"),
        ({"window": "day", "limit_usd": "1e100"}, "at most 1,000,000,000 USD"),
        ({"window": "day", "limit_usd": "0.0000001"}, "finer"),
        ({"window": "day", "limit_usd": "NaN"}, "finite"),
    ],
)
async def test_bad_arguments_are_value_errors_and_change_nothing(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    async with Gateway(tmp_path) as gw:
        with pytest.raises(ValueError, match=message):
            await gw.guard.admin.set_policy("acme", "alpha", **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await gw.guard.admin.set_policy("", window="day", limit_usd=1)
        assert await gw.guard.ledger.list_policies() == []


async def test_on_redis_a_change_reaches_every_replica_at_once(
    tmp_path: Path, redis_url: str
) -> None:
    stores = [RedisStore.from_url(redis_url, timeout=2.0) for _ in range(2)]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    try:
        async with (
            # Redis keeps real time: so must the gateways' clocks.
            Gateway(tmp_path / "a", utcnow, store=stores[0], database_url=db) as a,
            Gateway(tmp_path / "b", utcnow, store=stores[1], database_url=db) as b,
        ):
            assert await post(a) == await post(b) == 200  # both cached "no policy"
            await a.guard.admin.set_policy("acme", "alpha", window="month", limit_usd=0)
            assert await post(b) == 429  # the other replica, with no settlement pass
            await b.guard.admin.remove_policy("acme", "alpha", window="month")
            assert await post(a) == 200
    finally:
        for store in stores:
            await store.aclose()


async def test_the_top_ups_of_a_team_are_bounded_in_all(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        for _ in range(100):
            await gw.guard.admin.topup("acme", "1000000000")
        with pytest.raises(ValueError, match="would exceed"):
            await gw.guard.admin.topup("acme", "0.000001")
        report = await gw.guard.admin.balance("acme")
        assert report is not None and report.account.topped_up == MAX_TOTAL_MICROS


async def test_a_limit_stored_beyond_the_bound_is_checked_not_a_500(
    tmp_path: Path, redis_url: str
) -> None:
    """A row written before amounts were bounded (or by hand): the Redis scripts refuse such
    a value, which used to turn every request of the team into a 500."""
    store = RedisStore.from_url(redis_url, timeout=2.0)
    try:
        async with Gateway(tmp_path, utcnow, store=store) as gw:
            huge = Policy(key_limit(ALPHA, Period.DAY), 10**18, "acme", "alpha")
            await gw.guard.ledger.set_policy(huge, now=utcnow())
            assert await post(gw) == 200  # checked against the bound, and charged
            await gw.guard.recorder.flush()
            usage = await gw.guard.admin.usage("acme", "alpha")
            day = next(u for u in usage.limits if u.limit == key_limit(ALPHA, Period.DAY))
            assert day.cached is not None and day.cached > 0
    finally:
        await store.aclose()


async def test_the_example_admin_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/admin_api.py (docs/admin.md): the admin API behind a route of the gateway;
    its auth and its answers to bad input are tests/docs/test_admin_example.py's."""
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", f"sqlite:///{tmp_path / 'admin.db'}")
    monkeypatch.setenv("ADMIN_TOKEN", "t")
    example = importlib.import_module("examples.admin_api")
    example = importlib.reload(example)  # a fresh guard on this test's database
    async with lifespan(example.app):
        transport = httpx.ASGITransport(app=example.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as c:
            with anyio.fail_after(10):
                r = await c.put(
                    "/admin/teams/acme/limits/day?api_key=alpha",
                    json={"limit_usd": "5"},
                    headers={"authorization": "Bearer t"},
                )
        assert r.status_code == 200
        # The key's new day limit, beside the team's spend (no limit) of the day and month.
        limited = [row for row in r.json()["limits"] if row["limit_micros"] is not None]
        [row] = limited
        assert (row["period"], row["limit_micros"], row["remaining_micros"]) == (
            "day",
            5_000_000,
            5_000_000,
        )
        resets_at = datetime.fromisoformat(row["resets_at"].replace("Z", "+00:00"))
        assert resets_at == Period.DAY.end(datetime.now(UTC))
        policies = await example.guard.admin.list_policies("acme")
        assert [(p.limit, p.amount) for p in policies] == [
            (key_limit(ALPHA, Period.DAY), 5_000_000)
        ]


def test_admin_is_exported() -> None:
    import spendguard

    assert spendguard.Admin is type(SpendGuard(Settings(enabled=False)).admin)
