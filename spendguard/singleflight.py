"""Coalesce identical concurrent loads: 100 cache misses for one team make one ledger read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class _Call(Generic[T]):
    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._calls: dict[Hashable, _Call[T]] = {}

    async def do(self, key: Hashable, fn: Callable[[], Awaitable[T]]) -> T:
        call = self._calls.get(key)
        if call is not None:
            await call.done.wait()
            if call.error is not None:
                raise call.error
            return call.result  # type: ignore[return-value]
        call = self._calls[key] = _Call()
        try:
            call.result = await fn()
            return call.result
        except BaseException as exc:
            # Followers see the leader's failure (a cancelled leader must not hang them).
            call.error = exc if isinstance(exc, Exception) else RuntimeError("load cancelled")
            raise
        finally:
            del self._calls[key]
            call.done.set()
