"""Stand-ins for collaborators (a store, a ledger) that a test injects into spendguard: one
that fails on any use, one that counts the calls it forwards, one that replaces some methods."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class Exploding:
    """A store or ledger that fails the test on any use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls: list[str] = []

    def __getattr__(self, attr: str) -> Any:
        self.calls.append(attr)
        raise AssertionError(f"{self._name}.{attr} used on a path that must not touch it")


class Counting:
    """A collaborator (a store, a ledger) that counts the calls made to it, per method, and
    forwards them: tests show which requests never reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted

    def __len__(self) -> int:
        return len(self.inner)


class Override:
    """A collaborator with some methods replaced (a refresh that crashes, a slow load) and
    everything else forwarded to the real one: fault injection without touching the object
    the rest of the test keeps using."""

    def __init__(self, inner: Any, **methods: Any) -> None:
        self.inner = inner
        self.__dict__.update(methods)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
