"""The embedded pool store: the Redis store's semantics in one process.

Every method runs without an ``await`` between its reads and writes, so on one event loop each
call is as atomic as a Lua script. Provider keys are few (the operator registers them), so the
store needs no bound.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from .base import Acquired, Attempt, StoredKey
from .model import WINDOW_MS, ProviderKey, Refusal


@dataclass(slots=True)
class _Key:
    provider: str
    tpm: int | None
    rpm: int | None
    window: int = -1
    requests: int = 0
    tokens: int = 0
    cooling_until: int = 0

    def open(self, window: int) -> None:
        """Make ``window`` the counted one (a window that is over counts as 0)."""
        if self.window != window:
            self.window, self.requests, self.tokens = window, 0, 0


class MemoryPoolStore:
    shared = False  # one process: other replicas keep their own counters

    def __init__(self) -> None:
        self._keys: dict[str, _Key] = {}

    async def register(self, key: ProviderKey) -> None:
        found = self._keys.get(key.id)
        if found is None:
            self._keys[key.id] = _Key(key.provider, key.tpm, key.rpm)
        else:
            found.provider, found.tpm, found.rpm = key.provider, key.tpm, key.rpm

    async def remove(self, key_id: str) -> None:
        self._keys.pop(key_id, None)

    def acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Awaitable[Acquired]:
        return self._acquire(key_ids, tokens, now_ms)

    async def _acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Acquired:
        refused: list[Attempt] = []
        for i, key_id in enumerate(key_ids):
            attempt = self._try(key_id, tokens, now_ms)
            if attempt.granted:
                return Acquired(i, attempt.window)
            refused.append(attempt)
        return Acquired(None, refused=tuple(refused))

    def _try(self, key_id: str, tokens: int, now_ms: int) -> Attempt:
        key = self._keys.get(key_id)
        if key is None:
            return Attempt(Refusal.UNKNOWN)
        if key.cooling_until > now_ms:
            return Attempt(Refusal.COOLING, free_at_ms=key.cooling_until)
        if key.tpm is not None and tokens > key.tpm:
            return Attempt(Refusal.TOO_LARGE)
        window = now_ms // WINDOW_MS
        key.open(window)
        if (key.rpm is not None and key.requests + 1 > key.rpm) or (
            key.tpm is not None and key.tokens + tokens > key.tpm
        ):
            return Attempt(Refusal.FULL, free_at_ms=(window + 1) * WINDOW_MS)
        key.requests += 1
        key.tokens += tokens
        return Attempt(None, window=window)

    def settle(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> Awaitable[None]:
        return self._settle(key_id, window, reserved, actual, now_ms)

    async def _settle(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> None:
        key = self._keys.get(key_id)
        if key is None:
            return
        current = now_ms // WINDOW_MS
        if window == current and key.window == current:
            if actual is None:
                key.requests = max(0, key.requests - 1)
                key.tokens = max(0, key.tokens - reserved)
            else:
                key.tokens = max(0, key.tokens - reserved + actual)
        elif actual is not None and actual > reserved:
            key.open(current)
            key.tokens += actual - reserved

    async def cooldown(self, key_id: str, until_ms: int) -> int | None:
        key = self._keys.get(key_id)
        if key is None:
            return None
        key.cooling_until = max(key.cooling_until, until_ms)
        return key.cooling_until

    async def state(self, key_id: str, now_ms: int) -> StoredKey | None:
        key = self._keys.get(key_id)
        if key is None:
            return None
        live = key.window == now_ms // WINDOW_MS
        return StoredKey(
            key.provider,
            key.tpm,
            key.rpm,
            key.requests if live else 0,
            key.tokens if live else 0,
            key.cooling_until,
        )

    async def aclose(self) -> None:
        pass
