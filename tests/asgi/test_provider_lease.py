"""Provider keys leased at admission: the gateway declares a request's candidates, the lease
rides the admission's store call, reaches the app in the request state, and is settled with the
tokens used (or released) in the finishing one. A refusal by any check gives it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import spendguard_guard
from spendguard.limits import Period
from spendguard.providers import Lease, ProviderKey
from spendguard.providers.routing import STATE_PROVIDER_KEY
from tests.support import Gateway, chat_body, client, lifespan, write_unit_prices
from tests.support.budgets import BudgetGateway, section

pytestmark = pytest.mark.anyio

CANDIDATES = {"unit-*": ["key-a", "key-b"]}


class SeesLease:
    """The fake provider behind an app that notes the lease spendguard gave it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leases: list[Lease | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.leases.append(scope.get("state", {}).get(STATE_PROVIDER_KEY))
        await self.inner(scope, receive, send)


def with_lease_app(gw: Gateway) -> SeesLease:
    seen = SeesLease(gw.inner)
    gw.app.app.app = seen  # StateAuth -> middleware -> the app
    return seen


async def test_the_first_candidate_with_room_is_leased_and_settled_with_the_tokens_used(
    tmp_path: Path,
) -> None:
    async with Gateway(tmp_path, provider_candidates=CANDIDATES) as gw, gw.client() as c:
        seen = with_lease_app(gw)
        pool = gw.guard.pool
        await pool.register(ProviderKey("key-a", "fake", rpm=1), ProviderKey("key-b", "fake"))
        first = await c.post("/v1/chat/completions", json=chat_body(x_in=40, x_out=2))
        second = await c.post("/v1/chat/completions", json=chat_body(x_in=7, x_out=3))
        assert first.status_code == second.status_code == 200
        assert [lease.key_id if lease else None for lease in seen.leases] == ["key-a", "key-b"]
        a, b = await pool.state("key-a"), await pool.state("key-b")
        assert a is not None and b is not None
        # Each key's reservation became what the call used (prompt + output), once.
        assert (a.requests, a.tokens) == (1, 42)
        assert (b.requests, b.tokens) == (1, 10)
        assert all(lease is not None and lease.done for lease in seen.leases)


async def test_no_room_on_any_candidate_is_a_429_that_charges_nothing(tmp_path: Path) -> None:
    async with Gateway(tmp_path, provider_candidates=CANDIDATES) as gw, gw.client() as c:
        seen = with_lease_app(gw)
        pool = gw.guard.pool
        await pool.register(
            ProviderKey("key-a", "fake", rpm=1), ProviderKey("key-b", "fake", rpm=1)
        )
        for _ in range(2):
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        refused = await c.post("/v1/chat/completions", json=chat_body())
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "no_provider_capacity"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert "key-a" not in refused.text  # the gateway's key ids are its own business
        assert len(seen.leases) == 2  # the app was never called for it
        await gw.guard.recorder.flush()
        assert await gw.guard.ledger.unsettled() == (2, 2 * 15)  # two records, unit prices


async def test_unregistered_candidates_are_a_503(tmp_path: Path) -> None:
    async with Gateway(tmp_path, provider_candidates={"*": ["nowhere"]}) as gw, gw.client() as c:
        refused = await c.post("/v1/chat/completions", json=chat_body())
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_provider_key"


async def test_a_model_without_candidates_gets_no_lease(tmp_path: Path) -> None:
    candidates = {"gpt-*": ["key-a"]}
    async with Gateway(tmp_path, provider_candidates=candidates) as gw, gw.client() as c:
        seen = with_lease_app(gw)
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        assert seen.leases == [None]


async def test_an_upstream_error_releases_the_lease(tmp_path: Path) -> None:
    async with Gateway(tmp_path, provider_candidates=CANDIDATES) as gw, gw.client() as c:
        pool = gw.guard.pool
        await pool.register(ProviderKey("key-a", "fake", rpm=1))
        failed = await c.post("/v1/chat/completions", json=chat_body(x_status=500))
        assert failed.status_code == 500
        state = await pool.state("key-a")
        assert state is not None and (state.requests, state.tokens) == (0, 0)
        # The request and its tokens came back: the key's one request a minute is free again.
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200


async def test_a_spend_refusal_releases_the_lease(tmp_path: Path) -> None:
    async with Gateway(tmp_path, provider_candidates=CANDIDATES) as gw, gw.client() as c:
        pool = gw.guard.pool
        await pool.register(ProviderKey("key-a", "fake", rpm=5))
        await gw.policy(Period.DAY, 0)
        refused = await c.post("/v1/chat/completions", json=chat_body())
        assert refused.json()["error"]["code"] == "spend_limit_exceeded"
        state = await pool.state("key-a")
        assert state is not None and (state.requests, state.tokens) == (0, 0)


async def test_the_app_may_release_the_lease_and_choose_late(tmp_path: Path) -> None:
    """A router that fails over (a provider 429) releases spendguard's lease itself and
    leases another: spendguard then settles nothing twice."""
    async with Gateway(tmp_path, provider_candidates=CANDIDATES) as gw, gw.client() as c:
        pool = gw.guard.pool
        await pool.register(ProviderKey("key-a", "fake"), ProviderKey("key-b", "fake"))
        inner = gw.inner

        async def fails_over(scope: Scope, receive: Receive, send: Send) -> None:
            lease = scope["state"][STATE_PROVIDER_KEY]
            await pool.cooldown(lease.key_id, 30)
            await pool.release(lease)
            late = await pool.acquire(["key-a", "key-b"], tokens=5)
            await inner(scope, receive, send)
            await pool.settle(late, tokens=5)

        gw.app.app.app = fails_over
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        a, b = await pool.state("key-a"), await pool.state("key-b")
        assert a is not None and b is not None
        assert (a.requests, a.tokens) == (0, 0) and a.cooling_until is not None
        assert (b.requests, b.tokens) == (1, 5)


async def test_a_budget_refusal_withdraws_the_spend_admission_and_the_lease(
    tmp_path: Path,
) -> None:
    budgets = section(scopes={"per_api_key": {"tokens": 1}})
    gw = BudgetGateway(tmp_path, budgets=budgets, provider_candidates=CANDIDATES)
    async with gw, gw.client() as c:
        pool = gw.guard.pool
        await pool.register(ProviderKey("key-a", "fake", rpm=5))
        refused = await c.post("/v1/chat/completions", json=chat_body(max_tokens=10))
        assert refused.json()["error"]["code"] == "request_exceeds_budget"
        state = await pool.state("key-a")
        assert state is not None and (state.requests, state.tokens) == (0, 0)


async def test_the_depends_path_leases_after_the_apps_own_auth(tmp_path: Path) -> None:
    """Admission after the route's own auth dependency (``Depends(spendguard_guard)``): the
    lease is in the request state when the endpoint runs, and settled when it answered."""
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        prices=write_unit_prices(tmp_path),
        provider_candidates=CANDIDATES,
    )
    guard = SpendGuard(settings)
    leased: list[str] = []

    async def auth(request: Request, authorization: str = Header("")) -> None:
        if authorization != "Bearer sk-alpha":
            raise HTTPException(401, "unknown key")
        request.state.team_id, request.state.api_key_id = "acme", "alpha"

    async def provider(request: Request) -> JSONResponse:
        leased.append(getattr(request.state, STATE_PROVIDER_KEY).key_id)
        usage = {"prompt_tokens": 10, "completion_tokens": 5}
        return JSONResponse({"object": "chat.completion", "model": "unit-model", "usage": usage})

    app = FastAPI()
    deps = [Depends(auth), Depends(spendguard_guard)]
    app.post("/v1/chat/completions", dependencies=deps)(provider)
    app.add_middleware(SpendGuardMiddleware, guard=guard)
    async with lifespan(app), client(app) as c:
        await guard.pool.register(ProviderKey("key-a", "fake"))
        headers = {"authorization": "Bearer sk-alpha"}
        ok = await c.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert ok.status_code == 200, ok.text
        unknown = await c.post("/v1/chat/completions", json=chat_body())
        assert unknown.status_code == 401  # the app's own answer: nothing leased for it
        state = await guard.pool.state("key-a")
    assert leased == ["key-a"]
    assert state is not None and (state.requests, state.tokens) == (1, 15)


async def test_keys_in_the_settings_are_registered_at_start(tmp_path: Path) -> None:
    """Candidates and their keys from the settings alone (the environment): no code."""
    keys = [{"id": "key-a", "provider": "fake", "rpm": 1}, {"id": "key-b", "provider": "fake"}]
    gw = Gateway(tmp_path, provider_candidates=CANDIDATES, provider_keys=keys)
    async with gw, gw.client() as c:
        seen = with_lease_app(gw)
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        a = await gw.guard.pool.state("key-a")
        assert a is not None and (a.provider, a.rpm, a.tpm) == ("fake", 1, None)
    assert [lease.key_id if lease else None for lease in seen.leases] == ["key-a", "key-b", "key-b"]


@pytest.mark.parametrize(
    "keys",
    [
        [{"id": "", "provider": "fake"}],
        [{"id": "a", "provider": "fake", "tpm": -1}],
        [{"id": "a", "provider": "fake", "secret": "sk-..."}],
        [{"id": "a", "provider": "fake"}, {"id": "a", "provider": "other"}],
    ],
)
def test_bad_provider_keys_are_refused_at_configuration(keys: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="key"):
        Settings(provider_keys=keys)
