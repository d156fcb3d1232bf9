"""Small pieces: settings validation, id encoding, periods, single-flight, responses."""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
import pytest

from spendguard.engine.singleflight import SingleFlight
from spendguard.errors import ConfigurationError
from spendguard.identity import Identity, encode_id
from spendguard.limits import Period
from spendguard.money import micros_to_usd, usd_to_micros
from spendguard.settings import load_settings


@pytest.mark.parametrize(
    ("env", "value", "field"),
    [
        ("SPENDGUARD_SETTLE_INTERVAL", "-1", "SPENDGUARD_SETTLE_INTERVAL"),
        ("SPENDGUARD_KEY_PREFIX", "a{b}", "SPENDGUARD_KEY_PREFIX"),
        ("SPENDGUARD_DATABASE_URL", "mysql://x", "SPENDGUARD_DATABASE_URL"),
        ("SPENDGUARD_ROUTES", "v1/chat", "SPENDGUARD_ROUTES"),
        ("SPENDGUARD_REDIS_URL", "http://127.0.0.1:6379", "SPENDGUARD_REDIS_URL"),
        ("SPENDGUARD_PRICES", "/nonexistent/prices.json", "SPENDGUARD_PRICES"),
        ("SPENDGUARD_UNKNOWN_MODEL", "guess", "SPENDGUARD_UNKNOWN_MODEL"),
    ],
)
def test_invalid_settings_fail_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigurationError, match=field):
        load_settings()


def test_unknown_setting_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPENDGUARD_SETTLE_INTERVALL", "3")
    load_settings()
    assert "SPENDGUARD_SETTLE_INTERVALL" in caplog.text


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPENDGUARD_ROUTES", "/v1/chat/completions/, /custom/infer")
    monkeypatch.setenv("SPENDGUARD_ENABLED", "false")
    s = load_settings()
    assert s.routes == ("/v1/chat/completions", "/custom/infer") and not s.enabled


def test_encoded_ids_are_safe_and_injective() -> None:
    raws = [
        "acme",
        "a:b",
        "a%3Ab",
        "a{b}",
        "a b",
        "a\nb",
        "é",
        "e\u0301",
        "x" * 10_000,
        "x" * 10_001,
    ]
    encoded = [encode_id(r) for r in raws]
    assert len(set(encoded)) == len(raws)
    for e in encoded:
        assert e and len(e) <= 96
        assert not set(e) & set("{}: \n\r\t")
    assert encode_id("acme") == "acme"  # plain ids stay readable in keys and SQL
    with pytest.raises(ValueError):
        encode_id("")
    with pytest.raises(ValueError):
        Identity("")


def test_periods_are_utc_calendar_periods() -> None:
    t = datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert Period.DAY.bucket(t) == "20261231" and Period.MONTH.bucket(t) == "202612"
    assert Period.MONTH.end(t) == datetime(2027, 1, 1, tzinfo=UTC)
    assert Period.DAY.seconds_to_reset(t) == 1
    with pytest.raises(ValueError):
        Period.DAY.bucket(datetime(2026, 1, 1))  # naive: ambiguous, refused


def test_money_is_exact() -> None:
    assert usd_to_micros("5.00") == 5_000_000
    assert str(micros_to_usd(2**53 + 1)) == "9007199254.740993"
    with pytest.raises(ValueError):
        usd_to_micros("0.0000001")
    with pytest.raises(ValueError):
        usd_to_micros("NaN")


@pytest.mark.anyio
async def test_single_flight_coalesces_concurrent_loads() -> None:
    flight: SingleFlight[int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.05)
        return 42

    results: list[int] = []

    async def one() -> None:
        results.append(await flight.do("team", load))

    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(one)
    assert calls == 1 and results == [42] * 100
    assert await flight.do("team", load) == 42 and calls == 2  # not cached after it finished


@pytest.mark.anyio
async def test_single_flight_shares_failures() -> None:
    flight: SingleFlight[int] = SingleFlight()

    async def boom() -> int:
        await anyio.sleep(0.01)
        raise RuntimeError("db down")

    errors: list[str] = []

    async def one() -> None:
        try:
            await flight.do("k", boom)
        except RuntimeError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert errors == ["db down"] * 5


@pytest.mark.anyio
async def test_single_flight_survives_a_cancelled_leader() -> None:
    flight: SingleFlight[int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.1)
        return 7

    results: list[int] = []

    async def follower() -> None:
        await anyio.sleep(0.01)
        results.append(await flight.do("k", load))

    async with anyio.create_task_group() as tg:
        tg.start_soon(follower)
        with anyio.move_on_after(0.03):  # the leader's request goes away mid-load
            await flight.do("k", load)
    assert results == [7] and calls == 2
