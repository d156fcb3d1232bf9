"""What every admin route refuses: no token, a wrong token, routes that are off, hostile ids in
the path, bad JSON and bad amounts. Refusals are JSON 4xx errors, never a 500, and change
nothing in the ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from starlette.types import Message

from spendguard import Settings, SpendGuard, SpendGuardMiddleware
from spendguard.asgi import admin_app
from tests.admin_http.conftest import AUTH, PREFIX, TOKEN, AdminGateway, build_app
from tests.support import http_scope, upstream, write_unit_prices

pytestmark = pytest.mark.anyio

# Every route of the admin app, with a valid body where it takes one.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/status", None),
    ("GET", "/config", None),
    ("GET", "/policies", None),
    ("GET", "/teams/acme/policies", None),
    ("PUT", "/teams/acme/policies/day", {"limit_usd": "1"}),
    ("DELETE", "/teams/acme/policies/day", None),
    (
        "PUT",
        "/teams/acme/keys/alpha/policies/month",
        {"limit_usd": "1", "mode": "hard", "fit": True},
    ),
    ("DELETE", "/teams/acme/keys/alpha/policies/month", None),
    ("GET", "/teams/acme/usage", None),
    ("GET", "/teams/acme/keys/alpha/usage", None),
    ("GET", "/teams/acme/balance", None),
    ("POST", "/teams/acme/balance/topup", {"usd": "1"}),
    ("PUT", "/teams/acme/balance/mode", {"mode": "hard"}),
    ("GET", "/teams/acme/rates", None),
    ("PUT", "/teams/acme/rates/team", {"rpm": 100}),
    ("DELETE", "/teams/acme/rates/team", None),
    ("PUT", "/teams/acme/keys/alpha/rates", {"tpm": 1000, "max_parallel": 2}),
    ("DELETE", "/teams/acme/keys/alpha/rates", None),
    ("GET", "/teams/acme/models", None),
    ("POST", "/teams/acme/models/allow", {"models": ["gpt-4o*"]}),
    ("POST", "/teams/acme/keys/alpha/models/remove", {"models": ["gpt-4o*"]}),
    ("GET", "/budgets", None),
    ("POST", "/budgets/reset", {"scope": "global"}),
    ("GET", "/customers/globex/balance", None),
    ("POST", "/customers/globex/balance/topup", {"usd": "1"}),
    ("GET", "/alerts", None),
    ("GET", "/teams", None),
    ("GET", "/top", None),
    ("POST", "/alerts/test", None),
]
# The routes that name a team (and those that name a key): ids go where "acme"/"alpha" are.
TEAM_ROUTES = [r for r in ROUTES if "/teams/acme/" in r[1]]
KEY_ROUTES = [r for r in ROUTES if "/keys/alpha/" in r[1]]


def test_the_list_covers_every_route() -> None:
    app = admin_app(object(), token=TOKEN)
    served = {
        (method, route.path) for route in app.routes for method in route.methods if method != "HEAD"
    }
    listed = set()
    for method, path, _ in ROUTES:
        template = (
            path.replace("/teams/acme", "/teams/{team}")
            .replace("/customers/globex", "/customers/{customer}")
            .replace("/keys/alpha", "/keys/{key}")
            .replace("/policies/day", "/policies/{period}")
            .replace("/policies/month", "/policies/{period}")
            .replace("/models/allow", "/models/{action}")
            .replace("/models/remove", "/models/{action}")
        )
        listed.add((method, template))
    assert listed == served


async def nothing_changed(gw: AdminGateway) -> None:
    guard = gw.middleware.guard
    assert guard is not None
    assert await guard.admin.list_policies() == []
    assert await guard.admin.balance("acme") is None
    assert await guard.admin.list_models("acme") == {}


async def test_a_missing_token_is_a_401_on_every_route(gw: AdminGateway) -> None:
    for method, path, body in ROUTES:
        for headers in (
            {},
            {"authorization": ""},
            {"authorization": "Bearer"},
            {"authorization": "Bearer   "},
            {"authorization": f"Basic {TOKEN}"},
            {"authorization": TOKEN},
            {"x-api-key": TOKEN},
        ):
            answer = await gw.client.request(method, PREFIX + path, json=body, headers=headers)
            assert answer.status_code == 401, (method, path, headers)
            assert answer.headers["www-authenticate"].startswith("Bearer")
            assert answer.json()["error"]["code"] == "unauthorized"
    await nothing_changed(gw)


async def test_a_wrong_token_is_a_403_on_every_route(gw: AdminGateway) -> None:
    for method, path, body in ROUTES:
        for token in (TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "x" * len(TOKEN), "é" * 3):
            headers = {"authorization": f"Bearer {token}".encode()}
            answer = await gw.client.request(method, PREFIX + path, json=body, headers=headers)
            assert answer.status_code == 403, (method, path, token)
            assert answer.json()["error"]["code"] == "forbidden"
    await nothing_changed(gw)
    # The scheme is case-insensitive; the token is not.
    ok = await gw.client.get(PREFIX + "/status", headers={"authorization": f"bearer {TOKEN}"})
    assert ok.status_code == 200


async def test_every_route_answers_with_the_token(gw: AdminGateway) -> None:
    for method, path, body in ROUTES:
        answer = await gw.admin(method, path, json=body)
        assert answer.status_code < 500, (method, path, answer.text)
        # Budgets are not configured here; the policy deletes find nothing on the first pass.
        assert answer.status_code in (200, 404), (method, path, answer.text)
        assert answer.headers["content-type"] == "application/json"


async def test_off_without_a_token(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}", prices=write_unit_prices(tmp_path)
    )
    app = build_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for method, path, body in ROUTES:
            answer = await c.request(method, PREFIX + path, json=body, headers=AUTH)
            assert answer.status_code == 404, (method, path)
            assert "www-authenticate" not in answer.headers
    # An empty token is no token.
    assert Settings(admin_token="").admin_token is None


def test_a_token_with_whitespace_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="admin token"):
        Settings(admin_token="two words")


async def raw(app: Any, method: str, raw_path: str, body: bytes = b"") -> tuple[int, Any]:
    """One request as a server hands it over: ``raw_path`` exactly as sent (no client-side
    normalisation of dot segments or percent-escapes), ``path`` percent-decoded."""
    scope = http_scope(
        method,
        unquote(raw_path, errors="surrogateescape"),
        [(b"authorization", AUTH["authorization"].encode())],
        body,
    )
    scope["raw_path"] = raw_path.encode()
    sent: list[Message] = []
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return start["status"], json.loads(payload)
    except ValueError:
        return start["status"], payload


HOSTILE = [
    "..",
    ".",
    "%2E%2E",
    "%2e",
    "a%2Fb",
    "..%2F..%2Fetc",
    "a%5Cb",
    "x" * 257,
    "a%0Ab",
    "a%0D%0Ab",
    "%00",
    "a%09b",
    "%E2%80%8E",  # an invisible direction mark (a format character)
    "%1B%5B31m",  # a terminal escape
]


@pytest.mark.parametrize("hostile", HOSTILE)
async def test_hostile_ids_are_refused_on_every_route(gw: AdminGateway, hostile: str) -> None:
    routes = TEAM_ROUTES + [
        (m, p.replace("/teams/acme/", "/teams/ok/"), b) for m, p, b in KEY_ROUTES
    ]
    direct = admin_app(gw.middleware)  # the admin app itself, not behind the host's router
    for method, path, body in routes:
        place = "acme" if "/teams/acme/" in path else "alpha"
        target = path.replace(f"/{place}/", f"/{hostile}/", 1)
        content = b"" if body is None else json.dumps(body).encode()
        status, error = await raw(direct, method, target, content)
        assert status == 400, (target, status, error)
        assert error["error"]["code"] == "invalid_id", (target, error)
        # Through the host app: a 4xx too (its router may refuse a newline before the mount).
        status, _ = await raw(gw.app, method, PREFIX + target, content)
        assert 400 <= status < 500, (target, status)
    await nothing_changed(gw)


async def test_an_encoded_slash_never_names_another_route(gw: AdminGateway) -> None:
    # Decoded, this path would be /teams/x/keys/y/usage: team "x", key "y".
    status, error = await raw(gw.app, "GET", PREFIX + "/teams/x%2Fkeys%2Fy/usage")
    assert status == 400 and error["error"]["code"] == "invalid_id"


async def test_odd_but_valid_ids_are_their_own_teams(gw: AdminGateway) -> None:
    """Braces, colons, unicode and a 256-character id are the host app's ids as they are:
    each is its own team (encoded before it reaches a cache key or SQL)."""
    odd = ["{acme}", "acme}{", "ac:me", "équipe", "チーム", "%41cme", "x" * 256]
    for n, team in enumerate(odd, start=1):
        quoted = "".join(f"%{b:02X}" for b in team.encode())
        status, saved = await raw(
            gw.app,
            "PUT",
            f"{PREFIX}/teams/{quoted}/policies/day",
            json.dumps({"limit_usd": str(n)}).encode(),
        )
        assert status == 200, (team, saved)
        assert saved["team"] == team and saved["limit_micros"] == n * 1_000_000
    listed = (await gw.admin("GET", "/policies")).json()["policies"]
    assert sorted(p["team"] for p in listed) == sorted(odd)
    assert (await gw.admin("GET", "/teams/acme/policies")).json()["policies"] == []
    # Spend of the team "{acme}" is its own, and its cache keys keep one hash tag each.
    answer = await gw.chat(team="{acme}")
    assert answer.status_code == 200
    guard = gw.middleware.guard
    assert guard is not None
    await guard.recorder.flush()
    await guard.worker.run_once()
    status, usage = await raw(gw.app, "GET", f"{PREFIX}/teams/%7Bacme%7D/usage")
    assert status == 200 and usage["charges_total_micros"] == 15
    assert (await gw.admin("GET", "/teams/acme/usage")).json()["charges_total_micros"] == 0
    if gw.backend == "postgres_redis":
        from redis.asyncio import Redis

        assert gw.settings.redis_url is not None
        client = Redis.from_url(gw.settings.redis_url.get_secret_value())
        try:
            keys = [k.decode() async for k in client.scan_iter(f"{gw.settings.key_prefix}*")]
        finally:
            await client.aclose()
        assert any("{%7Bacme%7D}" in k for k in keys), keys  # the team's own hash tag
        assert all(k.count("{") <= 1 and k.count("}") <= 1 for k in keys), keys


BAD_LIMITS: list[tuple[bytes, int, str]] = [
    (b"", 400, "invalid_request"),
    (b"not json", 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
    (b"[]", 400, "invalid_request"),
    (b'"5"', 400, "invalid_request"),
    (b"{}", 400, "invalid_request"),
    (b'{"limit_usd": 0.1}', 400, "invalid_amount"),
    (b'{"limit_usd": true}', 400, "invalid_amount"),
    (b'{"limit_usd": null}', 400, "invalid_amount"),
    (b'{"limit_usd": ["1"]}', 400, "invalid_amount"),
    (b'{"limit_usd": "abc"}', 400, "invalid_amount"),
    (b'{"limit_usd": "NaN"}', 400, "invalid_amount"),
    (b'{"limit_usd": "Infinity"}', 400, "invalid_amount"),
    (b'{"limit_usd": "-1"}', 400, "invalid_amount"),
    (b'{"limit_usd": "0.0000001"}', 400, "invalid_amount"),
    (b'{"limit_usd": "1000000001"}', 400, "invalid_amount"),
    (b'{"limit_usd": "1e999999999"}', 400, "invalid_amount"),
    (b'{"limit_usd": 10000000000000000000000}', 400, "invalid_amount"),
    (b'{"limit_usd": "1", "mode": "medium"}', 400, "invalid_request"),
    (b'{"limit_usd": "1", "fit": true}', 400, "invalid_request"),  # fit: a hard limit's
    (b'{"limit_usd": "1", "mode": "hard", "fit": "yes"}', 400, "invalid_request"),
    (b'{"limit_usd": "1", "api_key": "alpha"}', 400, "invalid_request"),
    (b'{"limit_usd": "' + b"1" * 70_000 + b'"}', 413, "request_too_large"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_LIMITS)
async def test_bad_policy_bodies(gw: AdminGateway, body: bytes, status: int, code: str) -> None:
    for path in ("/teams/acme/policies/day", "/teams/acme/keys/alpha/policies/month"):
        answer = await gw.admin("PUT", path, content=body)
        assert answer.status_code == status, (body[:40], answer.text)
        assert answer.json()["error"]["code"] == code
    await nothing_changed(gw)


async def test_bad_bodies_elsewhere(gw: AdminGateway) -> None:
    cases: list[tuple[str, str, Any, int]] = [
        ("POST", "/teams/acme/balance/topup", {"usd": "0"}, 400),
        ("POST", "/teams/acme/balance/topup", {"usd": "-5"}, 400),
        ("POST", "/teams/acme/balance/topup", {"usd": 1.5}, 400),
        ("POST", "/teams/acme/balance/topup", {"amount": "1"}, 400),
        ("POST", "/teams/acme/balance/topup", ["1"], 400),
        ("PUT", "/teams/acme/balance/mode", {"mode": 1}, 400),
        ("PUT", "/teams/acme/balance/mode", {}, 400),
        ("POST", "/teams/acme/models/allow", {"models": []}, 400),
        ("POST", "/teams/acme/models/allow", {"models": "gpt-4o"}, 400),
        ("POST", "/teams/acme/models/allow", {"models": [1]}, 400),
        ("POST", "/teams/acme/models/allow", {"models": ["a\nb"]}, 400),
        ("POST", "/teams/acme/models/allow", {"models": [""]}, 400),
        ("POST", "/teams/acme/models/grant", {"models": ["x"]}, 404),
        ("PUT", "/teams/acme/policies/week", {"limit_usd": "1"}, 404),
        ("DELETE", "/teams/acme/policies/year", None, 404),
        ("GET", "/nothing/here", None, 404),
        ("GET", "/teams/acme", None, 404),
        ("POST", "/status", None, 405),
        ("PATCH", "/teams/acme/policies/day", None, 405),
        ("GET", "/teams/acme/balance/topup", None, 405),
    ]
    for method, path, body, status in cases:
        answer = await gw.admin(method, path, json=body)
        assert answer.status_code == status, (method, path, body, answer.text)
        assert answer.json()["error"]["message"]
    await nothing_changed(gw)


async def test_config_and_status_redact_every_secret(tmp_path: Path) -> None:
    settings = Settings(
        database_url="postgresql://gw:pg-secret@127.0.0.1:1/ledger?password=q-secret",
        redis_url="redis://:redis-secret@127.0.0.1:1/0",
        admin_token=TOKEN,
    )
    middleware = SpendGuardMiddleware(upstream(), settings=settings)
    app = admin_app(middleware)  # the middleware itself, never started: nothing connects
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        config = await c.get("/config", headers=AUTH)
        status = await c.get("/status", headers=AUTH)
    assert config.status_code == 200 and status.status_code == 200
    for text in (config.text, status.text):
        for secret in ("pg-secret", "q-secret", "redis-secret", TOKEN):
            assert secret not in text
    found = config.json()
    assert found["database_url"] == "postgresql://gw:***@127.0.0.1:1/ledger?password=***"
    assert found["redis_url"] == "redis://:***@127.0.0.1:1/0"
    assert found["admin_token"] == "***"
    assert status.json()["store"] == {
        "mode": "redis",
        "url": "redis://:***@127.0.0.1:1/0",
        "shared": True,
    }
    assert status.json()["lifespan"] == "not_started" and status.json()["running"] is False


async def test_a_disabled_middleware(tmp_path: Path) -> None:
    settings = Settings(
        enabled=False, admin_token=TOKEN, database_url=f"sqlite:///{tmp_path / 'l.db'}"
    )
    app = build_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        status = await c.get(PREFIX + "/status", headers=AUTH)
        refused = await c.put(
            PREFIX + "/teams/acme/policies/day", json={"limit_usd": "1"}, headers=AUTH
        )
        budgets = await c.get(PREFIX + "/budgets", headers=AUTH)
        config = await c.get(PREFIX + "/config", headers=AUTH)
    assert status.json()["enabled"] is False and status.json()["lifespan"] == "not_started"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "disabled"
    assert budgets.status_code == 503 and budgets.json()["error"]["code"] == "disabled"
    assert config.status_code == 200 and config.json()["enabled"] is False
    assert not (tmp_path / "l.db").exists()


async def test_an_app_without_the_middleware(tmp_path: Path) -> None:
    app = admin_app(upstream(), token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        answer = await c.get("/status", headers=AUTH)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready"


async def test_a_guard_as_the_source_with_its_own_token(tmp_path: Path) -> None:
    guard = SpendGuard(
        Settings(database_url=f"sqlite:///{tmp_path / 'l.db'}", prices=write_unit_prices(tmp_path))
    )
    app = admin_app(guard, token="another-token")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        assert (await c.get("/status", headers=AUTH)).status_code == 403
        auth = {"authorization": "Bearer another-token"}
        saved = await c.put("/teams/t/policies/day", json={"limit_usd": "2"}, headers=auth)
        assert saved.status_code == 200
        status = (await c.get("/status", headers=auth)).json()
    assert status["lifespan"] == "not_started" and status["record_writer"]["running"] is False
    assert [p.amount for p in await guard.admin.list_policies("t")] == [2_000_000]
    await guard.ledger.disconnect()
