"""The hot-path cache: the store Protocol, its two implementations, and how one is chosen.

A store is picked by the scheme of ``SPENDGUARD_REDIS_URL`` through a plain registry (no URL:
``memory://``, the embedded store). A new backend is one entry in :data:`STORES`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from ..clock import utcnow
from ..errors import ConfigurationError
from ..settings import Settings
from .base import (
    AlertMarks,
    CachedParts,
    EntryWrite,
    LimitState,
    Outcome,
    OwnerLog,
    Preflight,
    RefreshEntry,
    Store,
    UsageFill,
)
from .memory import MemoryStore
from .redis import REDIS_SCHEMES, RedisStore

StoreFactory = Callable[[str, Settings, Callable[[], datetime]], Store]


def _memory(url: str, settings: Settings, clock: Callable[[], datetime]) -> Store:
    return MemoryStore(max_keys=settings.memory_max_keys, clock=clock)


def _redis(url: str, settings: Settings, clock: Callable[[], datetime]) -> Store:
    return RedisStore.from_url(url, prefix=settings.key_prefix, timeout=settings.redis_timeout)


STORES: dict[str, StoreFactory] = {"memory": _memory, **dict.fromkeys(REDIS_SCHEMES, _redis)}


def store_url(settings: Settings) -> str:
    return "memory://" if settings.redis_url is None else settings.redis_url.get_secret_value()


def make_store(settings: Settings, clock: Callable[[], datetime] = utcnow) -> Store:
    """The store the settings ask for: Redis when a URL is set, else the embedded one."""
    return store_for(store_url(settings), settings, clock)


def store_for(url: str, settings: Settings, clock: Callable[[], datetime] = utcnow) -> Store:
    """The store of ``url`` (``memory://`` or a Redis URL), the rest from ``settings``."""
    scheme = url.partition("://")[0]
    factory = STORES.get(scheme)
    if factory is None:
        raise ConfigurationError(
            f"unsupported store URL scheme {scheme!r}: use one of "
            + ", ".join(f"{s}://" for s in STORES)
        )
    return factory(url, settings, clock)


__all__ = [
    "STORES",
    "AlertMarks",
    "CachedParts",
    "EntryWrite",
    "LimitState",
    "MemoryStore",
    "Outcome",
    "OwnerLog",
    "Preflight",
    "RedisStore",
    "RefreshEntry",
    "Store",
    "UsageFill",
    "make_store",
    "store_for",
]
