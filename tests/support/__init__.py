"""What the tests and the benchmarks share (``from tests.support import ...``).

=================  ==========================================================================
``ports``          free loopback ports
``processes``      the repository root, child processes that die with their parent, a clean
                   environment, uvicorn gateways, ``wait_healthy``, the CLI as a process
``redis``          private ``redis-server`` processes and a 3-master cluster
``postgres``       private PostgreSQL databases, emptying the spendguard tables
``proxy``          a loopback TCP proxy a test can cut (a database "goes down")
``clock``          a settable clock
``asgi``           the ASGI lifespan driver, a request scope, ``StateAuth`` (the host's auth)
``doubles``        ``Exploding``, ``Counting`` and ``Override`` collaborators
``prices``         a price table of one micro-USD per token
``records``        inference records as the engine writes them, a unit settlement price
``gateway``        the ``Gateway`` harness, the fake ``upstream()`` app, ``chat_body``
``sql``            reading the ledger's tables on a connection of the test's own
``bodies``         response bodies, chunkings and retained-bytes measurement for usage tests
``services``       skip locally / fail under CI when a service is missing (imports pytest)
``loops``          the event loops the tests run on (asyncio's, uvloop) as anyio backends
=================  ==========================================================================

The names below are re-exported here; ``services`` is not (the benchmarks run without pytest
in their path), import it as ``tests.support.services``; ``loops`` is not either, import it
as ``tests.support.loops``.
"""

from .asgi import StateAuth, http_scope, lifespan, raw_call
from .clock import Clock
from .doubles import Counting, Exploding, Override
from .gateway import MODEL, Gateway, chat_body, client, upstream
from .ports import HOST, free_port
from .postgres import PG_ADMIN_URL, TemporaryDatabase, truncate_spendguard_tables
from .prices import UNIT_MODEL, UNIT_PRICES, write_unit_prices
from .processes import (
    ROOT,
    call_cli,
    clean_env,
    die_with_parent,
    run_cli,
    serve_demo,
    spawn,
    stop,
    uvicorn,
    wait_healthy,
)
from .proxy import Rounds, TcpProxy
from .records import make_record, unit_price
from .redis import RedisCluster, RedisServer, RedisServerError, redis_version
from .sql import charges_in_month, sql_execute, sql_rows, sql_value, topups_total

__all__ = [
    "HOST",
    "MODEL",
    "PG_ADMIN_URL",
    "ROOT",
    "UNIT_MODEL",
    "UNIT_PRICES",
    "Clock",
    "Counting",
    "Exploding",
    "Gateway",
    "Override",
    "RedisCluster",
    "RedisServer",
    "RedisServerError",
    "Rounds",
    "StateAuth",
    "TcpProxy",
    "TemporaryDatabase",
    "call_cli",
    "charges_in_month",
    "chat_body",
    "clean_env",
    "client",
    "die_with_parent",
    "free_port",
    "http_scope",
    "lifespan",
    "make_record",
    "raw_call",
    "redis_version",
    "run_cli",
    "serve_demo",
    "spawn",
    "sql_execute",
    "sql_rows",
    "sql_value",
    "stop",
    "topups_total",
    "truncate_spendguard_tables",
    "unit_price",
    "upstream",
    "uvicorn",
    "wait_healthy",
    "write_unit_prices",
]
