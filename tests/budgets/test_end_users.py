"""End users, tags and customers, new subjects of the budgets: an end user's bucket (within its
team) gets the section's default from its very first request, atomically; a request must pass
the budget of every tag it carries and is counted in each; a customer's budget is shared by its
teams; records say whom and what they were for, and the usage reports by end user, tag and
customer agree with the records."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import httpx
import pytest
import sqlalchemy as sa
from starlette.types import Receive, Scope, Send

from spendguard.budgets import Scope as BudgetScope
from spendguard.engine.decision import InferenceRequest
from spendguard.engine.entries import closed_entry, open_entry, recovered_record
from spendguard.identity import Identity
from spendguard.ledger.schema import records
from spendguard.limits import Period
from spendguard.settings import Settings
from tests.support.budgets import BudgetGateway, section
from tests.support.clock import Clock
from tests.support.gateway import chat_body, upstream
from tests.support.records import make_record
from tests.support.sql import sql_rows

pytestmark = pytest.mark.anyio

EST = 100  # max_tokens=98 + the 2-token prompt: one request's admission estimate
USERS, EACH = 200, 2  # 400 requests at once: two from each of 200 never-seen end users


async def test_never_seen_end_users_each_get_the_default_from_their_first_request(
    tmp_path: Path, storage: dict[str, object]
) -> None:
    inner = upstream()
    release = anyio.Event()
    entered = 0

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal entered
        if scope["type"] == "http":
            entered += 1
            await release.wait()  # no hold is replaced before every request was decided
        await inner(scope, receive, send)

    kind = "redis" if storage else "memory"
    budgets = section(storage=kind, scopes={"per_end_user": {"tokens": EST}})
    outcome: list[tuple[str, int]] = []
    gw = BudgetGateway(
        tmp_path, budgets=budgets, app=gated, end_user_from="header:x-end-user", **storage
    )
    async with gw, gw.client() as c:

        async def one(user: str) -> None:
            r = await c.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=98),
                headers={"x-end-user": user},
            )
            outcome.append((user, r.status_code))
            if r.status_code == 429:
                assert r.json()["error"]["details"]["scope"] == "per_end_user"

        users = [f"user-{uuid.uuid4().hex[:6]}-{i}" for i in range(USERS)]
        async with anyio.create_task_group() as tg:
            for _ in range(EACH):
                for user in users:
                    tg.start_soon(one, user)
            with anyio.fail_after(30):
                while entered + len(outcome) < USERS * EACH:
                    await anyio.sleep(0.01)
            admitted_while_held = entered
            release.set()
        await gw.guard.recorder.flush()
        top = await gw.guard.admin.top_spenders("end_user", Period.DAY, 1000)
    admitted = Counter(user for user, status in outcome if status == 200)
    assert admitted_while_held == USERS
    assert admitted == dict.fromkeys(users, 1)  # each end user once, none twice, none refused
    assert {s.row.name: s.row.requests for s in top.spenders} == dict.fromkeys(users, 1)


async def test_a_request_passes_every_tag_it_carries_and_counts_in_each(tmp_path: Path) -> None:
    budgets = section(
        scopes={"per_tag": {"search": {"tokens": 150}, "*": {"tokens": 1_000_000}}},
    )
    gw = BudgetGateway(tmp_path, budgets=budgets, tags_from="header:x-tags")
    async with gw, gw.client() as c:

        async def post(tags: str, max_tokens: int) -> tuple[int, dict[str, object]]:
            r = await c.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=max_tokens),
                headers={"x-tags": tags},
            )
            return r.status_code, r.json()

        first, _ = await post("search, chat", 98)  # counts 15 tokens in both
        refused, body = await post("chat,search", 140)  # 142 more would pass search's 150
        other, _ = await post("chat", 140)
        await gw.guard.recorder.flush()
        counters = {(c.scope, c.subject): c.tokens for c in (await gw.budgets.inspect()).counters}
        top = await gw.guard.admin.top_spenders("tag", Period.DAY, 10)
        rows = await sql_rows(
            gw.settings.database_url.get_secret_value(),
            sa.select(records.c.tag_ids, records.c.estimate_micros),
        )
    assert (first, refused, other) == (200, 429, 200)
    error = body["error"]
    assert isinstance(error, dict)
    assert error["details"] == {
        "scope": "per_tag",
        "window": "hourly",
        "unit": "tokens",
        "limit": 150,
        "tag": "search",
    }
    assert "Tag 'search'" in error["message"]
    assert counters[(BudgetScope.PER_TAG, "search")] == 15
    assert counters[(BudgetScope.PER_TAG, "chat")] == 30
    # Usage by tag, recomputed from the records themselves.
    expected: dict[str, list[int]] = {}
    for tag_ids, estimate in rows:
        for tag in json.loads(tag_ids):
            expected.setdefault(tag, [0, 0])
            expected[tag][0] += estimate
            expected[tag][1] += 1
    assert {s.row.name: [s.row.spent, s.row.requests] for s in top.spenders} == expected
    assert expected == {"search": [15, 1], "chat": [30, 2]}


async def test_a_customers_budget_refuses_across_its_teams_and_names_the_customer(
    tmp_path: Path,
) -> None:
    """Customer > team > key: two teams of one customer share its bucket; the refusal names
    the customer level, not a team's or a key's."""
    budgets = section(
        scopes={
            "per_api_key": {"tokens": 10_000},
            "per_customer": {"globex": {"tokens": 110}, "*": {"tokens": 10_000}},
        }
    )
    gw = BudgetGateway(tmp_path, budgets=budgets, customer_from="header:x-customer")
    async with gw, gw.client() as c:

        async def post(team: str, customer: str) -> tuple[int, dict[str, object]]:
            r = await c.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=98),
                headers={"x-test-team": team, "x-test-key": "k1", "x-customer": customer},
            )
            return r.status_code, r.json()

        acme, _ = await post("acme", "globex")  # 15 of globex's 110 tokens
        initech, refused = await post("initech", "globex")  # 100 more would pass 110
        other, _ = await post("initech", "hooli")  # another customer: its own bucket
        await gw.guard.recorder.flush()
        top = await gw.guard.admin.top_spenders("customer", Period.DAY, 10)
    assert (acme, initech, other) == (200, 429, 200)
    error = refused["error"]
    assert isinstance(error, dict)
    assert error["details"] == {
        "scope": "per_customer",
        "window": "hourly",
        "unit": "tokens",
        "limit": 110,
        "customer": "globex",
    }
    assert error["message"].startswith("Customer 'globex' token budget exceeded")
    assert {s.row.name: s.row.requests for s in top.spenders} == {"globex": 1, "hooli": 1}


async def test_the_clients_user_field_counts_only_when_the_settings_trust_it(
    tmp_path: Path,
) -> None:
    budgets = section(scopes={"per_end_user": {"tokens": EST}})
    for n, (sources, second) in enumerate((("state", 200), ("state,body", 429))):
        (tmp_path / str(n)).mkdir()
        gw = BudgetGateway(tmp_path / str(n), budgets=budgets, end_user_from=sources)
        async with gw, gw.client() as c:
            statuses = [
                (
                    await c.post("/v1/chat/completions", json=chat_body(max_tokens=98, user="u1"))
                ).status_code
                for _ in range(2)
            ]
        # Untrusted (the default): no end user, no end-user budget. Trusted: one request's
        # worth is one request, the second answer 15 tokens later does not fit.
        assert statuses == [200, second], sources


async def test_an_unusable_end_user_or_tag_is_a_400_and_costs_nothing(tmp_path: Path) -> None:
    budgets = section(scopes={"per_end_user": {"tokens": EST}})
    gw = BudgetGateway(
        tmp_path, budgets=budgets, end_user_from="header:x-end-user", tags_from="header:x-tags"
    )
    async with gw, gw.client() as c:
        long_user = await c.post(
            "/v1/chat/completions", json=chat_body(), headers={"x-end-user": "u" * 300}
        )
        many_tags = await c.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers={"x-tags": ",".join(f"t{i}" for i in range(17))},
        )
    assert long_user.status_code == many_tags.status_code == 400
    assert "256 characters" in long_user.json()["error"]["message"]
    assert gw.postflights == 0 and "insert_records" not in gw.ledger.calls


def test_an_admission_entry_keeps_the_end_user_and_tags_through_recovery() -> None:
    request = InferenceRequest("gpt-4o-mini", False, 40, estimated_input_tokens=12)
    request.end_user, request.tags, request.customer = "user 7", ("search", "a,b"), "globex"
    alpha = Identity("acme", "alpha")
    opened = recovered_record("r1", open_entry("gw", alpha, 1, "i1", request, "/v1/x"), 0)
    assert (opened.end_user, opened.tags, opened.customer) == (
        "user 7",
        ("search", "a,b"),
        "globex",
    )
    record = make_record("r2", opened.t0, 25)
    record.end_user, record.tags = "user 7", ("search",)
    closed = recovered_record("r2", closed_entry("gw", record, 1), 0)
    assert (closed.end_user, closed.tags, closed.customer) == ("user 7", ("search",), None)
    # An entry of an earlier release has neither.
    plain = InferenceRequest("gpt-4o-mini", False, 40, estimated_input_tokens=12)
    old = recovered_record("r3", open_entry("gw", alpha, 1, "i3", plain, "/v1/x"), 0)
    assert (old.end_user, old.tags, old.customer) == (None, (), None)


async def test_one_end_users_budget_is_reset_and_no_one_elses(tmp_path: Path) -> None:
    budgets = section(scopes={"per_end_user": {"tokens": EST}})
    gw = BudgetGateway(tmp_path, budgets=budgets, end_user_from="header:x-end-user")
    async with gw, gw.client() as c:

        async def post(user: str) -> int:
            r = await c.post(
                "/v1/chat/completions", json=chat_body(max_tokens=98), headers={"x-end-user": user}
            )
            return r.status_code

        spent = [await post(u) for u in ("u1", "u1", "u2", "u2")]
        with pytest.raises(ValueError, match="needs team_id"):
            await gw.budgets.reset("per_end_user", end_user="u1")
        with pytest.raises(ValueError, match="only for scope per_tag"):
            await gw.budgets.reset("per_end_user", tag="search")
        assert await gw.budgets.reset("per_end_user", team_id="acme", end_user="u1") == 1
        after = [await post("u1"), await post("u2")]
    assert spent == [200, 429, 200, 429]
    assert after == [200, 429]  # u1 has its budget again; u2 still has none


RATE_WINDOWS = [{"id": "minute", "period": "1m"}, {"id": "daily", "period": "24h"}]


async def test_an_end_users_request_rate_holds_under_concurrency(
    tmp_path: Path, storage: dict[str, object]
) -> None:
    """A rate per end user (two requests a rolling minute, beside a daily token quota): 100
    concurrent requests of 20 never-seen end users admit exactly two of each."""
    inner = upstream()
    release = anyio.Event()
    entered = 0

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal entered
        if scope["type"] == "http":
            entered += 1
            await release.wait()
        await inner(scope, receive, send)

    budgets = section(
        storage="redis" if storage else "memory",
        windows=RATE_WINDOWS,
        scopes={"per_end_user": {"tokens": 1_000_000, "windows": {"minute": {"requests": 2}}}},
    )
    outcome: list[tuple[str, int]] = []
    gw = BudgetGateway(
        tmp_path, budgets=budgets, app=gated, end_user_from="header:x-end-user", **storage
    )
    users = [f"rate-{uuid.uuid4().hex[:6]}-{i}" for i in range(20)]
    async with gw, gw.client() as c:

        async def one(user: str) -> None:
            r = await c.post("/v1/chat/completions", json=chat_body(), headers={"x-end-user": user})
            outcome.append((user, r.status_code))
            if r.status_code == 429:
                details = r.json()["error"]["details"]
                assert details == {
                    "scope": "per_end_user",
                    "window": "minute",
                    "unit": "requests",
                    "limit": 2,
                }

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                for user in users:
                    tg.start_soon(one, user)
            with anyio.fail_after(30):
                while entered + len(outcome) < 100:
                    await anyio.sleep(0.01)
            release.set()
        report = await gw.budgets.inspect()
    admitted = Counter(user for user, status in outcome if status == 200)
    assert admitted == dict.fromkeys(users, 2)
    assert sorted(s for _, s in outcome) == [200] * 40 + [429] * 60
    counted = {c.subject: c.requests for c in report.counters if c.window == "minute"}
    assert counted == {f"acme:{user}": 2 for user in users}


async def test_a_tags_request_rate_refuses_with_a_retry_and_leaves_other_tags(
    tmp_path: Path,
) -> None:
    budgets = section(
        windows=RATE_WINDOWS,
        scopes={"per_tag": {"batch": {"windows": {"minute": {"requests": 1}}}}},
    )
    gw = BudgetGateway(tmp_path, budgets=budgets, tags_from="header:x-tags")
    async with gw, gw.client() as c:

        async def post(tags: str) -> httpx.Response:
            return await c.post("/v1/chat/completions", json=chat_body(), headers={"x-tags": tags})

        first, refused, other = await post("batch"), await post("chat, batch"), await post("chat")
    assert (first.status_code, refused.status_code, other.status_code) == (200, 429, 200)
    error = refused.json()["error"]
    assert error["message"] == "Tag 'batch' request budget exceeded for window 'minute'."
    assert 1 <= int(refused.headers["retry-after"]) <= 60  # when the first leaves the minute


async def test_tags_and_the_customer_from_allow_listed_body_fields(tmp_path: Path) -> None:
    """A gateway whose clients send their tags as LiteLLM's do (``metadata.tags``) lists that
    field; the customer from another one. Fields not listed count for nothing."""
    budgets = section(
        scopes={
            "per_tag": {"search": {"tokens": 150}},
            "per_customer": {"globex": {"tokens": 10_000}},
        }
    )
    gw = BudgetGateway(
        tmp_path,
        budgets=budgets,
        tags_from="body:metadata.tags",
        customer_from="body:metadata.org",
    )
    async with gw, gw.client() as c:

        async def post(max_tokens: int = 98, **extra: object) -> int:
            body = chat_body(max_tokens=max_tokens, **extra)
            return (await c.post("/v1/chat/completions", json=body)).status_code

        meta = {"tags": ["search"], "org": "globex"}
        first = await post(metadata=meta)  # 15 of search's 150
        refused = await post(metadata=meta, max_tokens=140)  # 142 more would pass 150
        unlisted = await post(tags=["search"], max_tokens=140)  # a field not listed
        bad = await post(metadata={"tags": "search"})  # not a list
        counters = {(c.scope, c.subject): c.tokens for c in (await gw.budgets.inspect()).counters}
    assert (first, refused, unlisted, bad) == (200, 429, 200, 400)
    assert counters[(BudgetScope.PER_TAG, "search")] == 15
    assert counters[(BudgetScope.PER_CUSTOMER, "globex")] == 15


def test_a_body_source_names_a_field() -> None:
    assert Settings(tags_from="body:metadata.tags").tags_from == ("body:metadata.tags",)
    for bad in ("body:", "body:a..b", "body"):
        with pytest.raises(ValueError, match="body:<field>"):
            Settings(tags_from=bad)


async def test_an_end_users_spend_limit_on_the_utc_calendar_month(tmp_path: Path) -> None:
    """Apps bill their end users by the calendar month: a utc:month window resets on the 1st
    at 00:00 UTC, and a refusal's Retry-After says when."""
    clock = Clock(datetime(2026, 9, 30, 23, 59, 0, tzinfo=UTC))  # a minute before October
    budgets = section(
        windows=[{"id": "month", "period": "utc:month"}],
        # One request's worth of dollars (the test's prices: a micro-dollar a token).
        scopes={"per_end_user": {"cost_usd": "0.0001"}},
    )
    gw = BudgetGateway(tmp_path, clock=clock, budgets=budgets, end_user_from="header:x-end-user")
    async with gw, gw.client() as c:

        async def post() -> httpx.Response:
            body = chat_body(max_tokens=98)
            return await c.post("/v1/chat/completions", json=body, headers={"x-end-user": "u1"})

        first, refused = await post(), await post()
        clock.now += timedelta(seconds=61)  # 1 October
        october = await post()
    assert (first.status_code, refused.status_code, october.status_code) == (200, 429, 200)
    assert refused.json()["error"]["details"] == {
        "scope": "per_end_user",
        "window": "month",
        "unit": "cost_micro_usd",
        "limit_micro_usd": EST,
    }
    assert refused.headers["retry-after"] == "60"


async def test_a_customers_prepaid_balance_is_shared_by_its_teams_and_topped_up(
    tmp_path: Path, storage: dict[str, object]
) -> None:
    """Customer > team: one prepaid account for every team of the customer, checked in the
    same round; used up, both teams are refused until a top-up, another customer is not."""
    budgets = section(storage="redis" if storage else "memory")  # no limits: the balance alone
    gw = BudgetGateway(tmp_path, budgets=budgets, customer_from="header:x-customer", **storage)
    async with gw, gw.client() as c:

        async def post(team: str, customer: str) -> httpx.Response:
            return await c.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=98),  # holds 100 micro-USD, uses 15
                headers={"x-test-team": team, "x-test-key": "k1", "x-customer": customer},
            )

        opened = await gw.budgets.topup_customer("globex", "0.00011")
        first = await post("acme", "globex")
        same_team, other_team = await post("acme", "globex"), await post("initech", "globex")
        no_account = await post("initech", "hooli")
        await gw.budgets.topup_customer("globex", "0.0001")
        topped = await post("initech", "globex")
        balance = await gw.budgets.customer_balance("globex")
        assert await gw.budgets.customer_balance("hooli") is None
    assert opened.topped_up == 110 and opened.used == 0
    assert first.status_code == 200 and no_account.status_code == 200
    for refused in (same_team, other_team):
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["details"]["scope"] == "per_customer"
        assert error["details"]["window"] == "prepaid"
        assert error["message"].startswith("Customer 'globex' prepaid balance exhausted")
        assert "retry-after" not in refused.headers
    assert topped.status_code == 200
    assert balance is not None and (balance.topped_up, balance.used, balance.left) == (210, 30, 180)


@pytest.mark.parametrize(("rule", "used"), [("default_price", 15), ("free", 0)])
async def test_a_model_without_a_price_draws_the_prepaid_balance_as_the_ledger_charges_it(
    tmp_path: Path, rule: str, used: int, storage: dict[str, object]
) -> None:
    """A prepaid account is money: a model missing from the price table draws it as the
    ledger charges it, by the unknown-model rule (the ``default`` entry, 1 micro-USD per token
    here; nothing with ``free``), never at nothing while the ledger charges it."""
    gw = BudgetGateway(
        tmp_path,
        budgets=section(storage="redis" if storage else "memory"),
        customer_from="header:x-customer",
        unknown_model=rule,
        **storage,
    )
    async with gw, gw.client() as c:

        async def post() -> httpx.Response:
            return await c.post(
                "/v1/chat/completions",
                json=chat_body(model="model-nobody-priced", max_tokens=98),  # holds 100
                headers={"x-customer": "globex"},
            )

        await gw.budgets.topup_customer("globex", "0.00011")
        first, second = await post(), await post()  # 110 - 15 = 95 left: no room for 100
        await gw.guard.recorder.flush()
        balance = await gw.budgets.customer_balance("globex")
        rows = await sql_rows(
            gw.settings.database_url.get_secret_value(), sa.select(records.c.estimate_micros)
        )
    assert first.status_code == 200
    assert balance is not None and balance.used == used
    assert sum(charge for (charge,) in rows) == used  # what the ledger charged
    if used:
        assert second.status_code == 429
        assert second.json()["error"]["details"]["window"] == "prepaid"
    else:
        assert second.status_code == 200


async def test_a_model_without_a_price_counts_tokens_only_in_a_cost_budget(tmp_path: Path) -> None:
    """Without a prepaid account a budget counts a model the table does not price in tokens
    only, and a cost-only budget does not limit it (the budgets' statement 18), whatever the
    ledger charges it."""
    budgets = section(scopes={"per_api_key": {"cost_usd": 0.00005, "tokens": 1_000_000}})
    gw = BudgetGateway(tmp_path, budgets=budgets)
    async with gw, gw.client() as c:
        answers = [
            await c.post(
                "/v1/chat/completions", json=chat_body(model="model-nobody-priced", max_tokens=98)
            )
            for _ in range(3)
        ]
        counters = (await gw.budgets.inspect()).counters
    assert [a.status_code for a in answers] == [200, 200, 200]
    key = next(c for c in counters if c.scope is BudgetScope.PER_API_KEY)
    assert (key.tokens, key.cost_micros) == (45, 0)
