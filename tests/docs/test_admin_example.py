"""examples/admin_api.py, meant to be copied: bearer-token auth, and bad input answered with a
4xx naming the problem, never a 500 with a traceback."""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support import ROOT

EXAMPLE = ROOT / "examples" / "admin_api.py"
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
URL = "/admin/teams/acme/limits/day"


def load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str) -> Any:
    """A fresh copy of the example's app (its settings and token are read at import)."""
    for name in [n for n in __import__("os").environ if n.startswith("SPENDGUARD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", f"sqlite:///{tmp_path / 'admin.db'}")
    monkeypatch.setenv("ADMIN_TOKEN", token)
    return runpy.run_path(str(EXAMPLE))["app"]


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(load(monkeypatch, tmp_path, TOKEN), raise_server_exceptions=False) as c:
        yield c


def test_a_limit_is_set_and_its_usage_returned(client: TestClient) -> None:
    r = client.put(URL, json={"limit_usd": "5"}, headers=AUTH, params={"api_key": "alpha"})
    assert r.status_code == 200, r.text
    day = next(row for row in r.json()["limits"] if row["period"] == "day" and row["api_key"])
    assert day["limit_usd"] == "5.000000" and day["remaining_usd"] == "5.000000"


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"authorization": "Bearer wrong"}, 401), ({"authorization": TOKEN}, 401)],
)
def test_no_change_without_the_token(
    client: TestClient, headers: dict[str, str], status: int
) -> None:
    r = client.put(URL, json={"limit_usd": "5"}, headers=headers)
    assert r.status_code == status
    assert r.headers["www-authenticate"] == "Bearer"


def test_off_without_a_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with TestClient(load(monkeypatch, tmp_path, "")) as c:
        assert (
            c.put(URL, json={"limit_usd": "5"}, headers={"authorization": "Bearer "}).status_code
            == 404
        )


@pytest.mark.parametrize(
    ("url", "body", "params", "field"),
    [
        ("/admin/teams/acme/limits/week", {"limit_usd": "5"}, {}, "window"),  # not a Period
        (URL, {"limit_usd": "-1"}, {}, "limit_usd"),  # negative
        (URL, {"limit_usd": "0.0000001"}, {}, "limit_usd"),  # below one micro-USD
        (URL, {"limit_usd": "NaN"}, {}, "limit_usd"),
        (URL, {"limit_usd": "1e12"}, {}, "limit_usd"),  # above the bound
        (URL, {"limit_usd": "five"}, {}, "limit_usd"),
        (URL, {}, {}, "limit_usd"),
        (URL, {"limit_usd": "5", "mode": "strict"}, {}, "mode"),
        (URL, {"limit_usd": "5"}, {"api_key": ""}, None),  # an empty key id: the admin API's check
    ],
)
def test_bad_input_is_a_422_naming_it(
    client: TestClient, url: str, body: dict[str, str], params: dict[str, str], field: str | None
) -> None:
    r = client.put(url, json=body, headers=AUTH, params=params)
    assert r.status_code == 422, r.text
    if field is not None:
        assert field in r.text
    assert "Traceback" not in r.text
