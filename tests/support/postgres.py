"""Private PostgreSQL databases on an existing server: created for a test session or a
benchmark run and dropped after it, so a machine's own databases are never touched.

The server comes from ``SPENDGUARD_TEST_POSTGRES_URL`` (an admin URL; default: the local
server as user ``postgres``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from types import TracebackType
from typing import Self

PG_ADMIN_URL = os.environ.get(
    "SPENDGUARD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


async def _execute(url: str, sql: str) -> str:
    """Run ``sql`` on its own connection; returns the server's version."""
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    conn = await asyncpg.connect(url, timeout=5)
    try:
        await conn.execute(sql)
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


class TemporaryDatabase:
    """A database of its own (``<prefix>_<random>``), dropped ``WITH (FORCE)`` at the end so
    a client still connected (a gateway process) cannot keep it alive.

    ``create()`` raises what asyncpg or the socket raise when the server is unreachable.
    """

    def __init__(self, admin_url: str | None = None, prefix: str = "spendguard_test") -> None:
        self.admin_url = admin_url or PG_ADMIN_URL
        self.name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.created = False
        self.server_version = ""

    @property
    def url(self) -> str:
        return f"{self.admin_url.rsplit('/', 1)[0]}/{self.name}"

    def create(self) -> Self:
        self.server_version = asyncio.run(
            _execute(self.admin_url, f'CREATE DATABASE "{self.name}"')
        )
        self.created = True
        return self

    def drop(self) -> None:
        if self.created:
            asyncio.run(
                _execute(self.admin_url, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            )
            self.created = False

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.drop()


def truncate_spendguard_tables(url: str) -> None:
    """Empty every ``spendguard_*`` table of the database at ``url`` (its schema stays)."""
    asyncio.run(
        _execute(
            url,
            "DO $$ DECLARE t text; BEGIN FOR t IN SELECT tablename FROM pg_tables "
            "WHERE schemaname = 'public' AND tablename LIKE 'spendguard_%' LOOP "
            "EXECUTE 'TRUNCATE ' || quote_ident(t); END LOOP; END $$",
        )
    )
