"""Exceptions raised by spendguard.

    SpendGuardError
     ├── ConfigurationError   invalid settings, price file or wiring; raised at start
     ├── StoreUnavailable     the cache store (embedded or Redis) could not answer
     │    └── StoreFull       the embedded store hit its size bound (never allow untracked)
     └── LedgerUnavailable    the SQL ledger could not be read or written
          ├── LedgerBusy      another connection held SQLite's write lock too long
          ├── LedgerDown      no connection, or it broke (the server down, out of connections)
          └── LedgerRefused   the server answered and refused the data (out of range, invalid)

Every error that wraps a lower-level failure keeps it as ``__cause__``.
"""

from __future__ import annotations


class SpendGuardError(Exception):
    """Base class of every spendguard error."""


class ConfigurationError(SpendGuardError):
    """Settings, price table or middleware wiring are invalid."""


class StoreUnavailable(SpendGuardError):
    """The store could not answer; the request is denied (fail closed) or tracked locally."""


class StoreFull(StoreUnavailable):
    """The embedded store reached its bound; new keys are refused rather than left untracked."""


class LedgerUnavailable(SpendGuardError):
    """The SQL ledger failed; reads during a cache miss turn into 503 responses."""


class LedgerBusy(LedgerUnavailable):
    """Another connection held the ledger's write lock for too long (SQLite): nothing is wrong
    with the data, so a write is retried later rather than isolated as a refused record."""


class LedgerDown(LedgerUnavailable):
    """No connection to the database (refused, broken, out of connection slots): whatever was
    being written is fine and is retried, never isolated as a refused record."""


class LedgerRefused(LedgerUnavailable):
    """The database answered and refused the data itself (a value out of range, text it can't
    store): retrying the same record can't succeed."""
