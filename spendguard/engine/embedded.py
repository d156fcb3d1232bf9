"""One process per ledger for the embedded store (design.md, "One process per embedded store").

The embedded store counts spend in the memory of the process that runs it. Two processes on
the same ledger (``--workers 2``, two replicas on one volume) would each admit up to every
limit, so a hard limit would silently hold N times its amount. A guard on the embedded store
and a SQLite ledger therefore claims the database: an exclusive ``flock`` on a file beside it,
which the kernel drops when the process ends however it ends (a SIGKILL included), so a
restart after a crash is never blocked. A second process is refused at start, loudly.

Within one process the claim is shared: the test suite runs several guards on one database,
and a process that builds two guards can see them both; what the claim stops is the
multiplication nobody sees, across processes. ``flock`` conflicts between two descriptors of
one process too, so the process keeps one descriptor per database and counts its holders.

A PostgreSQL ledger is reached from other machines, where no file lock can look: the guard only
warns (:data:`POSTGRES_WARNING`).
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from typing import IO

from ..errors import ConfigurationError

_SUFFIX = ".embedded.lock"


@dataclass
class _Held:
    handle: IO[bytes]
    holders: int


_held: dict[str, _Held] = {}  # the lock file's real path -> this process's descriptor
_mutex = threading.Lock()  # guards started from several threads share the registry


def lock_path(database: str) -> str:
    """The lock file of a SQLite database file."""
    return f"{database}{_SUFFIX}"


class EmbeddedClaim:
    """This process's claim on one SQLite ledger; :meth:`release` once, when the guard stops."""

    def __init__(self, key: str) -> None:
        self._key: str | None = key

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        with _mutex:
            held = _held.get(key)
            if held is None:  # forgotten in a forked child: the parent still holds it
                return
            held.holders -= 1
            if held.holders == 0:
                del _held[key]
                held.handle.close()  # the last descriptor of this process: the lock goes


def claim_sqlite(database: str) -> EmbeddedClaim:
    """Claim ``database`` (a SQLite file) for this process's embedded store, or raise
    :class:`ConfigurationError` naming the process that holds it."""
    path = lock_path(database)
    key = os.path.realpath(path)
    with _mutex:
        held = _held.get(key)
        if held is not None:
            held.holders += 1
            return EmbeddedClaim(key)
        try:
            handle = open(path, "a+b")  # noqa: SIM115 - held until the last release
        except OSError as exc:
            raise ConfigurationError(
                f"spendguard cannot open {path}, the lock file that keeps a second process from "
                f"running the embedded store on the same database: {exc}"
            ) from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _owner(handle)
            handle.close()
            raise ConfigurationError(_refusal(database, owner)) from None
        # The pid is only for the message of the process refused next; the lock is the flock.
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n".encode())
        handle.flush()
        _held[key] = _Held(handle, 1)
        return EmbeddedClaim(key)


def _owner(handle: IO[bytes]) -> str:
    handle.seek(0)
    text = handle.read(32).decode("ascii", "replace").strip()
    # Empty while the holder is between its flock and its write.
    return f"pid {text}" if text.isdigit() else "pid unknown"


def _refusal(database: str, owner: str) -> str:
    return (
        f"spendguard refused to start: the embedded store (no SPENDGUARD_REDIS_URL) counts spend "
        f"in this process only, and another process ({owner}) already runs it on the database "
        f"{database}, so N workers would admit N times every limit. Run one worker process, or "
        "set SPENDGUARD_REDIS_URL (e.g. redis://127.0.0.1:6379/0) to share the counts between "
        "several workers or replicas."
    )


POSTGRES_WARNING = (
    "spendguard runs the embedded store (no SPENDGUARD_REDIS_URL) with a PostgreSQL ledger: "
    "its limits count in this process only, so N workers or replicas on this database admit up "
    "to N times every limit, and nothing here can see the others. Run one process, or set "
    "SPENDGUARD_REDIS_URL to share the counts between several workers or replicas."
)


def _forget_in_child() -> None:
    global _mutex
    _mutex = threading.Lock()  # another thread may have held it at the fork
    # A forked child inherits the descriptors, and with them the lock: were it to keep them, a
    # child outliving the gateway would block the gateway's restart. Closing the child's copy
    # leaves the parent's lock in place (the lock belongs to the open file, shared by both).
    for held in _held.values():
        held.handle.close()
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)
