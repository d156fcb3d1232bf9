"""Response bodies as the usage tests feed them: recorded provider bodies, SSE built from
events, chunkings (random, byte by byte), and how much of a body an observer still holds."""

from __future__ import annotations

import gc
import json
import random
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from spendguard.usage import UsageObserver

WIRE: Final = Path(__file__).resolve().parent.parent / "fixtures" / "wire"
"""Bodies and streams recorded from the real providers."""

SSE: Final = "text/event-stream; charset=utf-8"
JSON: Final = "application/json"


def load(name: str) -> bytes:
    """A recorded body from ``tests/fixtures/wire``."""
    return (WIRE / name).read_bytes()


def sse(*events: object) -> bytes:
    """An SSE body from JSON-able events (or raw strings used as the data verbatim)."""
    return "".join(
        f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n" for event in events
    ).encode()


def random_chunks(data: bytes, seed: int, max_size: int = 97) -> list[bytes]:
    """``data`` cut at random places (reproducibly, from ``seed``), chunks of 1..max_size."""
    rng = random.Random(seed)
    chunks = []
    pos = 0
    while pos < len(data):
        size = rng.randint(1, max_size)
        chunks.append(data[pos : pos + size])
        pos += size
    return chunks


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def observe(
    dialect: str, content_type: str | None, chunks: Iterable[bytes], **options: int
) -> UsageObserver:
    """A :class:`UsageObserver` fed every chunk (``options``: ``max_buffer`` and the like)."""
    observer = UsageObserver(dialect, content_type, **options)  # type: ignore[arg-type]
    for chunk in chunks:
        observer.feed(chunk)
    return observer


_BUFFERS = (bytes, bytearray, memoryview, str)
_CONTAINERS = (dict, list, tuple, set, frozenset, deque)


def retained_bytes(obj: object) -> int:
    """How many bytes of body data ``obj`` holds on to: the sizes of every bytes, bytearray,
    memoryview and str reachable from it through containers and spendguard objects.

    What a bounded buffer promises is observable this way from the outside, whatever the
    observer calls its internals. Shared immutables (classes, functions, modules) are not
    followed, so the count is the object's own data.
    """
    seen: set[int] = set()
    total = 0
    stack: list[Any] = [obj]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, _BUFFERS):
            total += node.nbytes if isinstance(node, memoryview) else len(node)
            continue
        if not (isinstance(node, _CONTAINERS) or type(node).__module__.startswith("spendguard.")):
            continue
        stack.extend(gc.get_referents(node))
    return total
