"""The pool's values and the checks on what a caller passes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from spendguard.limits.capacity import MAX_AMOUNT
from spendguard.providers import NoCapacity, ProviderKey, ProviderPool, Refusal
from spendguard.store.memory import MemoryStore
from tests.support import Clock

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "kwargs",
    [
        {"id": "", "provider": "openai"},
        {"id": "a", "provider": ""},
        {"id": "a", "provider": "openai", "tpm": -1},
        {"id": "a", "provider": "openai", "rpm": 1.5},
        {"id": "a", "provider": "openai", "rpm": True},
        {"id": "a", "provider": "openai", "tpm": MAX_AMOUNT + 1},
    ],
)
def test_bad_provider_keys_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ProviderKey(**kwargs)  # type: ignore[arg-type]


def test_no_capacity_says_when_to_retry_in_whole_seconds() -> None:
    now = datetime(2026, 9, 30, 12, 0, 0, 250_000, tzinfo=UTC)
    error = NoCapacity({"a": Refusal.COOLING}, now + timedelta(seconds=2.5), now)
    assert error.retry_after == 3
    assert "a: cooling" in str(error)
    assert NoCapacity({}, None, now).retry_after is None


@pytest.mark.parametrize("tokens", [-1, 1.0, MAX_AMOUNT + 1, True])
async def test_bad_token_counts_are_refused(tokens: object) -> None:
    pool = ProviderPool(MemoryStore(), clock=Clock())
    await pool.register(ProviderKey("a", "openai"))
    with pytest.raises(ValueError):
        await pool.acquire(["a"], tokens=tokens)  # type: ignore[arg-type]
    lease = await pool.acquire(["a"], tokens=1)
    with pytest.raises(ValueError):
        await pool.settle(lease, tokens=tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds", [-1, float("nan")])
async def test_bad_cooldowns_are_refused(seconds: float) -> None:
    pool = ProviderPool(MemoryStore(), clock=Clock())
    await pool.register(ProviderKey("a", "openai"))
    with pytest.raises(ValueError):
        await pool.cooldown("a", seconds)
