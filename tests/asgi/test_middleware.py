"""The ASGI adapter end to end (tests/support/gateway.py): the embedded store and real SQLite,
driven through httpx and by hand (raw ASGI messages)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.types import ASGIApp

from spendguard import Settings, SpendGuardMiddleware
from spendguard.clock import to_micros
from spendguard.errors import LedgerUnavailable
from spendguard.identity import Identity
from spendguard.ledger.schema import records
from spendguard.limits import Period, key_limit, team_limit
from spendguard.store.memory import MemoryStore
from tests.support import (
    Clock,
    Exploding,
    Gateway,
    StateAuth,
    chat_body,
    client,
    lifespan,
    raw_call,
    sql_rows,
    upstream,
    write_unit_prices,
)

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
KEY_DAY, TEAM_MONTH = key_limit(ALPHA, Period.DAY), team_limit(ALPHA, Period.MONTH)


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with Gateway(tmp_path) as gateway:
        yield gateway


async def test_key_day_under_limit_but_team_month_exhausted_is_429(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    await gw.policy(Period.MONTH, 15, key=None)
    async with gw.client() as c:
        ok = await c.post("/v1/chat/completions", json=chat_body())  # 10 + 5 = 15 micro-USD
        denied = await c.post("/v1/chat/completions", json=chat_body())
    assert ok.status_code == 200
    assert denied.status_code == 429
    assert denied.json() == {
        "error": {
            "type": "insufficient_quota",
            "code": "spend_limit_exceeded",
            "message": "Team monthly spend limit exceeded: limit $0.000015, resets at "
            "2026-10-01T00:00:00Z.",
        }
    }
    # Retry-After: seconds from 2026-09-30 12:00 UTC to October 1st.
    assert denied.headers["retry-after"] == str(12 * 3600)


async def test_limit_zero_blocks_and_anthropic_routes_get_their_envelope(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 0)
    async with gw.client() as c:
        openai_style = await c.post("/v1/chat/completions", json=chat_body())
        anthropic_style = await c.post("/v1/messages", json=chat_body(max_tokens=10))
    assert openai_style.status_code == anthropic_style.status_code == 429
    assert openai_style.content == (
        b'{"error":{"type":"insufficient_quota","code":"spend_limit_exceeded",'
        b'"message":"API Key daily spend limit exceeded: limit $0.00, resets at '
        b'2026-10-01T00:00:00Z."}}'
    )
    assert anthropic_style.json() == {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": "API Key daily spend limit exceeded: limit $0.00, resets at "
            "2026-10-01T00:00:00Z.",
        },
    }
    assert gw.postflights == 0
    assert await gw.guard.ledger.unsettled() == (0, 0)


async def test_no_policy_means_no_usage_lookups(gw: Gateway) -> None:
    async with gw.client() as c:
        for _ in range(5):
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    assert gw.ledger.calls["load_limits"] == 1  # "no policy", cached after the first miss
    assert gw.ledger.calls["load_aggregates"] == 0
    # No usage key was made (or looked up to be filled): only the "no policy" hash is cached.
    keys = [c.usage_key for c in gw.guard.codec.plan(ALPHA, gw.clock()).checks]
    assert await gw.store.read_usage(keys) == dict.fromkeys(keys)
    await gw.settle()
    assert await gw.guard.ledger.charges_total() == 5 * 15  # still recorded and charged


@pytest.mark.parametrize(("prior", "allowed"), [(15, False), (14, True)])
async def test_usage_equal_to_limit_denies_one_micro_below_allows(
    gw: Gateway, prior: int, allowed: bool
) -> None:
    await gw.policy(Period.DAY, 15)
    async with gw.client() as c:
        first = await c.post("/v1/chat/completions", json=chat_body(x_in=prior, x_out=0))
        assert first.status_code == 200
        await gw.settle()
        second = await c.post("/v1/chat/completions", json=chat_body())
    assert (second.status_code == 200) is allowed
    assert await gw.aggregates() == {(KEY_DAY, "20260930"): prior + (15 if allowed else 0)} or (
        allowed  # the second request is recorded but not settled yet
    )


async def test_call_started_before_midnight_settles_into_that_day_and_month(
    tmp_path: Path,
) -> None:
    clock = Clock(datetime(2026, 9, 30, 23, 59, 59, 999000, tzinfo=UTC))
    async with Gateway(tmp_path, clock) as gateway:
        await gateway.policy(Period.DAY, 1_000_000)
        await gateway.policy(Period.MONTH, 1_000_000, key=None)
        async with gateway.client() as c:
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        clock.now = datetime(2026, 10, 1, 0, 0, 3, tzinfo=UTC)
        await gateway.settle()
        assert await gateway.aggregates() == {
            (KEY_DAY, "20260930"): 15,
            (TEAM_MONTH, "202609"): 15,
        }


async def test_streaming_with_and_without_usage_is_charged(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    async with gw.client() as c:
        with_usage = await c.post(
            "/v1/chat/completions",
            json=chat_body(stream=True, stream_options={"include_usage": True}, x_in=100, x_out=3),
        )
        without = await c.post("/v1/chat/completions", json=chat_body(stream=True, x_chunks=8))
    assert with_usage.status_code == without.status_code == 200
    assert with_usage.text.endswith("data: [DONE]\n\n")
    await gw.settle()
    rows = await gw.guard.ledger.aggregates()
    # 103 exact; the usage-less stream is estimated from its prompt and 8 × "word " (40 chars).
    assert rows[0].settled > 103
    assert gw.postflights == 2


@pytest.mark.parametrize("bad", [-5, 1.5, "7", True, 10**12])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_served_answer_with_invalid_token_counts_is_charged_its_estimate(
    gw: Gateway, bad: object, stream: bool
) -> None:
    """Not $0: the usage is not trusted, and the charge falls back to the estimate from the
    prompt and the text served, flagged as estimated."""
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body(x_in=100, x_out=bad, **options))
    assert r.status_code == 200
    await gw.guard.recorder.flush()
    columns = (records.c.input_tokens, records.c.output_tokens, records.c.usage_estimated)
    rows = await sql_rows(gw.settings.database_url.get_secret_value(), sa.select(*columns))
    # The prompt's strings ("user", "hi") are 2 input tokens by estimate, not the reported 100;
    # 3 x "word " streamed is 15 characters, 4 output tokens; the JSON answer has no text.
    assert rows == [(2, 4 if stream else 0, True)]


@pytest.mark.parametrize(("encoding", "charged"), [("gzip", 10 + 1000), ("br", 100)])
async def test_compressed_responses_are_still_charged(
    gw: Gateway, encoding: str, charged: int
) -> None:
    await gw.policy(Period.DAY, 10**9)
    async with gw.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json=chat_body(x_in=10, x_out=1000, x_encoding=encoding),
            headers={"accept-encoding": "identity"},
        )
    assert r.status_code == 200
    await gw.settle()
    total = await gw.guard.ledger.charges_total()
    if encoding == "gzip":
        assert total == charged  # the provider's own usage, read through the gzip layer
    else:
        # Unreadable: 4 characters per body byte (100 bytes = 100 tokens) plus the prompt.
        assert total >= charged


async def test_upstream_error_is_not_charged(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body(x_status=500))
    assert r.status_code == 500
    await gw.settle()
    assert await gw.guard.ledger.charges_total() == 0
    assert await gw.guard.ledger.unsettled() == (0, 0)
    day_key = gw.guard.codec.check(KEY_DAY, gw.clock()).usage_key
    assert await gw.store.read_usage([day_key]) == {
        day_key: 0
    }  # filled by preflight, never charged


async def test_client_disconnect_mid_stream_postflights_exactly_once(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    body = json.dumps(chat_body(stream=True, x_stall_at=2, x_chunks=5)).encode()
    with anyio.fail_after(5):
        sent = await raw_call(gw.app, body, disconnect_after=0.2)
    assert sent[0]["status"] == 200 and len(sent) >= 3  # start + 2 chunks reached the client
    assert gw.postflights == 1
    await gw.guard.recorder.flush()
    count, estimate = await gw.guard.ledger.unsettled()
    assert count == 1 and estimate > 0  # charged what was served (estimated)


async def test_send_failure_mid_stream_postflights_exactly_once(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    body = json.dumps(chat_body(stream=True, x_chunks=5)).encode()
    with anyio.fail_after(5):
        await raw_call(gw.app, body, fail_send_after=2)
    assert gw.postflights == 1
    await gw.guard.recorder.flush()
    assert (await gw.guard.ledger.unsettled())[0] == 1


async def test_app_exception_mid_stream_still_postflights_once(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    body = json.dumps(chat_body(stream=True, x_fail_at=2)).encode()
    with pytest.raises(RuntimeError, match="mid-stream"):
        await raw_call(gw.app, body)
    assert gw.postflights == 1
    await gw.guard.recorder.flush()
    assert (await gw.guard.ledger.unsettled())[0] == 1


async def test_cancelled_request_still_postflights(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 1_000_000)
    real = gw.store.postflight

    async def yielding(*args: Any) -> Any:
        await anyio.sleep(0.01)  # a real store awaits I/O here: cancellation would land
        return await real(*args)

    gw.store.postflight = yielding
    body = json.dumps(chat_body(stream=True, x_stall_at=1)).encode()
    with anyio.move_on_after(0.3):
        await raw_call(gw.app, body)
    assert gw.postflights == 1
    await gw.guard.recorder.flush()
    assert (await gw.guard.ledger.unsettled())[0] == 1


async def test_non_inference_routes_touch_nothing(tmp_path: Path) -> None:
    store, ledger = Exploding("store"), Exploding("ledger")
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'x.db'}", prices=write_unit_prices(tmp_path)
    )
    app = StateAuth(SpendGuardMiddleware(upstream(), settings, store=store, ledger=ledger))  # type: ignore[arg-type]
    async with client(app) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/health", json={})).status_code == 200
        r = await c.get("/v1/chat/completions")  # an inference path, but not a POST
        assert r.status_code != 429 and "x-spendguard-inference-id" not in r.headers
    assert store.calls == [] and ledger.calls == []


async def test_disabled_is_a_strict_no_op(tmp_path: Path) -> None:
    db = tmp_path / "never.db"
    settings = Settings(enabled=False, database_url=f"sqlite:///{db}")
    app = StateAuth(SpendGuardMiddleware(upstream(), settings))
    async with (
        lifespan(app),
        client(app) as c,
    ):
        r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    assert not any(h.startswith("x-spendguard") for h in r.headers)
    assert not db.exists()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"messages": []}', 400),
        (b'{"model": "unit-model", "max_tokens": -1}', 400),
        (b'{"model": "unit-model", "max_tokens": 1.5}', 400),
        (b'{"model": "unit-model", "max_tokens": NaN}', 400),
        (b'{"model": "unit-model", "max_tokens": 100000000000000000000}', 400),
        (b"\xff\xfe", 400),
        (b'{"model": "unit-model", "pad": "' + b"x" * 3000 + b'"}', 413),
    ],
)
async def test_bad_input_is_a_4xx_with_no_charge(tmp_path: Path, body: bytes, status: int) -> None:
    gateway = Gateway(tmp_path, max_body_bytes=2048)
    async with gateway, gateway.client() as c:
        await gateway.policy(Period.DAY, 1_000_000)
        preflights = gateway.store.calls["preflight"]
        r = await c.post("/v1/chat/completions", content=body)
        assert r.status_code == status
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert gateway.postflights == 0 and gateway.store.calls["preflight"] == preflights
        await gateway.guard.recorder.flush()
        assert await gateway.guard.ledger.unsettled() == (0, 0)


async def test_missing_identity_is_401_and_headers_are_not_identity(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path)
    app = SpendGuardMiddleware(upstream(), guard=gateway.guard)  # no auth in front
    async with (
        gateway,
        client(app) as c,
    ):
        r = await c.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers={"x-team-id": "acme", "x-api-key-id": "alpha", "x-test-team": "acme"},
        )
        a = await c.post("/anthropic/v1/messages", json=chat_body())
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_identity"
    assert a.status_code == 401 and a.json()["error"]["type"] == "authentication_error"
    assert len(gateway.store) == 0


async def test_resolver_sync_and_async(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path)
    await gateway.__aenter__()
    try:
        await gateway.policy(Period.DAY, 0, key="blocked")
        for resolver in (lambda conn: ("acme", "blocked"), _async_resolver):
            app = SpendGuardMiddleware(upstream(), guard=gateway.guard, resolve_identity=resolver)
            async with client(app) as c:
                assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 429
    finally:
        await gateway.__aexit__()


async def test_resolver_that_raises_is_a_401_not_a_500(tmp_path: Path) -> None:
    def broken(conn: Any) -> Identity:
        raise KeyError("key")

    async with Gateway(tmp_path) as gateway:
        app = SpendGuardMiddleware(upstream(), guard=gateway.guard, resolve_identity=broken)
        async with client(app) as c:
            r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 401


async def _async_resolver(conn: Any) -> Identity:
    return Identity("acme", "blocked")


async def test_trailing_slash_and_mount_prefix_match(gw: Gateway) -> None:
    await gw.policy(Period.DAY, 0)
    mounted = Starlette()
    mounted.mount("/gw", gw.app)
    async with client(mounted) as c:
        assert (await c.post("/gw/v1/chat/completions", json=chat_body())).status_code == 429
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions/", json=chat_body())).status_code == 429


async def test_retry_marked_by_the_host_keeps_t0_and_inference_id(gw: Gateway) -> None:
    first_t0 = gw.clock.now
    seen: list[dict[str, Any]] = []

    class RetryMarker:
        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("state", {}).update(
                spendguard_inference_id="inf-1", spendguard_t0=first_t0
            )
            await self.app(scope, receive, send)
            seen.append(dict(scope["state"]))

    gw.clock.now = first_t0.replace(hour=13)
    app = RetryMarker(gw.app)
    async with client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.headers["x-spendguard-inference-id"] == "inf-1"
    assert seen[0]["spendguard_t0"] == first_t0


@pytest.mark.parametrize(
    "hostile", ["inf\x00nul", "inf\r\nx-injected: 1", "with space", "é", "x" * 65, ""]
)
async def test_a_retry_mark_with_an_unusable_inference_id_counts_as_a_new_inference(
    gw: Gateway, hostile: str, caplog: pytest.LogCaptureFixture
) -> None:
    first_t0 = gw.clock.now

    class RetryMarker:
        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("state", {}).update(
                spendguard_inference_id=hostile, spendguard_t0=first_t0
            )
            await self.app(scope, receive, send)

    gw.clock.now = first_t0.replace(hour=13)
    async with client(RetryMarker(gw.app)) as c:
        r = await c.post("/v1/chat/completions", json=chat_body())
    # The response is served and names a fresh inference; the record is the request's own.
    assert r.status_code == 200
    fresh = r.headers["x-spendguard-inference-id"]
    assert fresh != hostile and re.fullmatch(r"[0-9a-f]{32}", fresh)
    await gw.guard.recorder.flush()
    rows = await sql_rows(gw.settings.database_url.get_secret_value(), sa.select(records))
    assert [(row[0], row[1], row[8]) for row in rows] == [(fresh, fresh, to_micros(gw.clock.now))]
    assert "unusable inference id" in caplog.text


async def test_ledger_failure_on_a_cache_miss_is_503_with_retry_after(gw: Gateway) -> None:
    async def down(*args: Any) -> Any:
        raise LedgerUnavailable("connection refused")

    gw.guard.ledger.load_limits = down  # type: ignore[method-assign]
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body())
        a = await c.post("/v1/messages", json=chat_body(max_tokens=5))
    assert r.status_code == a.status_code == 503
    assert (
        r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "spend_limit_unavailable"
    )
    assert a.json()["type"] == "error"
    assert gw.postflights == 0


async def test_full_embedded_store_refuses_instead_of_allowing_untracked(tmp_path: Path) -> None:
    clock = Clock()
    async with Gateway(tmp_path, clock, store=MemoryStore(max_keys=1, clock=clock)) as gateway:
        await gateway.policy(Period.DAY, 1_000_000)
        async with gateway.client() as c:
            r = await c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503  # policy + usage key need 2 slots
        assert gateway.postflights == 0


async def test_unknown_model_can_be_rejected_before_the_provider(tmp_path: Path) -> None:
    async with Gateway(tmp_path, unknown_model="reject") as gateway, gateway.client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body(model="mystery-model"))
        ok = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 400 and "mystery-model" in r.json()["error"]["message"]
    assert ok.status_code == 200
