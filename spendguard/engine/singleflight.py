"""Coalesce identical concurrent loads: 100 cache misses for one team make one ledger read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class _Call(Generic[T]):
    __slots__ = ("cancelled", "done", "error", "result")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.cancelled = False
        self.result: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._calls: dict[Hashable, _Call[T]] = {}

    async def do(self, key: Hashable, fn: Callable[[], Awaitable[T]]) -> T:
        while True:
            call = self._calls.get(key)
            if call is None:
                break
            await call.done.wait()
            if call.error is not None:
                raise call.error
            if not call.cancelled:
                return call.result  # type: ignore[return-value]
            # The leader was cancelled (its request went away): load again, one of us leads.
        call = self._calls[key] = _Call()
        try:
            call.result = await fn()
            return call.result
        except Exception as exc:
            call.error = exc  # followers share the leader's failure
            raise
        except BaseException:
            call.cancelled = True
            raise
        finally:
            del self._calls[key]
            call.done.set()
