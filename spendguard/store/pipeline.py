"""Concurrent script calls, coalesced into pipelines (design.md, "The Redis store").

Every hot-path decision is one EVALSHA. Sent one by one, each costs a pooled connection, a
round trip of its own and redis-py's per-command overhead, and under load the pool serialises
them. Here the calls that requests make in the same event-loop turn, or while earlier batches
are in flight, leave as one non-transactional pipeline: one write, one round trip, replies in
order. Each caller still gets its own reply or its own error; a script that refuses its input
fails only its caller.

The deadline is one per batch and starts when the batch is taken for sending, so it measures
Redis (and the connection), not how long a request waited for the event loop. A call never
waits for long in the queue either: it is queued only while every sender is busy, and when a
batch fails (its deadline, a broken connection) the calls queued behind it fail with it
instead of being sent to a Redis that just did not answer. So a call ends within about twice
the timeout however Redis fails, and a slow event loop alone never fails one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
import hiredis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ..errors import StoreUnavailable
from . import wire

__all__ = ["BatchStats", "ScriptPipeline", "bounded_call", "store_error"]

T = TypeVar("T")


class Script(Protocol):
    """What a call needs of redis-py's registered ``Script``: its digest and its text."""

    sha: str
    script: Any  # str or bytes, as registered


def store_error(exc: BaseException) -> Exception:
    """The store's exception for what Redis or the connection raised.

    The scripts refuse bad input with an error reply that names spendguard: that is the
    caller's mistake (ValueError). Anything else means Redis could not decide.
    """
    if isinstance(exc, ResponseError):
        if "spendguard" in str(exc):
            error: Exception = ValueError(str(exc))
        else:
            error = StoreUnavailable(f"redis error: {exc}")
    else:
        # The class and the message: redis-py's own repr of its errors drops the message.
        error = StoreUnavailable(f"redis unavailable: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


async def bounded_call(fn: Callable[[], Awaitable[T]], seconds: float) -> T:
    """One Redis call on its own (off the hot path), bounded by ``seconds`` from its start;
    what Redis or the connection raised comes out as :func:`store_error`'s exception."""
    try:
        with anyio.fail_after(seconds):
            return await fn()
    except (RedisError, OSError, TimeoutError) as exc:
        raise store_error(exc) from exc


@dataclass(slots=True)
class _Call:
    script: Script
    keys: Sequence[str]
    args: Sequence[str]
    future: asyncio.Future[Any]
    queued_at: float


@dataclass(slots=True)
class BatchStats:
    """What the pipeline has sent; tests and benchmarks read it."""

    batches: int = 0  # pipelines executed, a NOSCRIPT retry included
    calls: int = 0  # script calls sent (a retried call counts again)
    largest: int = 0  # the most calls one pipeline carried


class ScriptPipeline:
    """Coalesces script calls into pipelines of at most ``max_batch`` EVALSHAs, with at most
    ``max_in_flight`` pipelines under way at once (each on its own connection)."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        timeout: float,
        max_batch: int = 256,
        max_in_flight: int = 4,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be at least 1")
        self._client = client
        self._transport: _Transport
        if isinstance(client, RedisCluster):
            self._transport = _ClusterPipelines(client)
        elif wire.supports(client):
            self._transport = wire.WireConnections(client)
        else:  # TLS, a credential provider, RESP3: redis-py's own connections
            self._transport = _Connections(client)
        self._timeout = timeout
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._queue: deque[_Call] = deque()
        self._senders: set[asyncio.Task[None]] = set()
        # A sender created but not yet running: it will take everything queued by then, so
        # the calls of one loop turn start one sender, not one each.
        self._starting: asyncio.Task[None] | None = None
        # When a batch last failed as a whole: calls queued before then are not sent.
        self._failed_at = float("-inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = BatchStats()

    def submit(
        self, script: Script, keys: Sequence[str], args: Sequence[str]
    ) -> asyncio.Future[Any]:
        """Queue one EVALSHA; the future holds its reply or the store's exception."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Call(script, keys, args, future, loop.time()))
        if self._starting is None and len(self._senders) < self._max_in_flight:
            self._spawn()
        return future

    async def aclose(self) -> None:
        """Stop every sender and fail what is still queued (the store is closing)."""
        senders = list(self._senders)
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        self._fail(self._queue, StoreUnavailable("redis store closed"))
        self._queue.clear()
        await self._transport.aclose()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start afresh in another event loop (a store used by one ``asyncio.run`` after
        another): a sender of the old loop may never run again, and would hold the queue."""
        self._loop = loop
        self._queue.clear()  # callers of a finished loop wait no more
        self._senders = set()
        self._starting = None
        self._failed_at = float("-inf")
        self._transport.forget()

    # -- senders --------------------------------------------------------------------------
    def _spawn(self) -> None:
        task = asyncio.get_running_loop().create_task(self._run())
        self._starting = task
        self._senders.add(task)
        task.add_done_callback(self._sender_done)

    def _sender_done(self, task: asyncio.Task[None]) -> None:
        # Only for a sender cancelled before it ran; one that ran has left already.
        self._senders.discard(task)
        if self._starting is task:
            self._starting = None

    async def _run(self) -> None:
        self._starting = None
        try:
            # Loop while calls keep arriving: those queued while a batch was in flight form
            # the next one.
            while batch := self._take():
                if (
                    self._queue
                    and self._starting is None
                    and len(self._senders) < self._max_in_flight
                ):
                    self._spawn()  # more than one batch is waiting: send the next alongside
                await self._send(batch)
        finally:
            # Leave the set now, in the step that found the queue empty. A done-callback
            # runs a loop turn later, after the callers this sender just answered have
            # called again: they would find every sender "busy", and no sender would come.
            self._senders.discard(asyncio.current_task())

    def _take(self) -> list[_Call]:
        """Up to ``max_batch`` queued calls that are still wanted."""
        batch: list[_Call] = []
        queue = self._queue
        while queue and len(batch) < self._max_batch:
            call = queue.popleft()
            if call.future.done():
                continue  # its caller gave up (cancelled): nothing to send
            if call.queued_at < self._failed_at:
                # It waited behind a batch that Redis did not answer in time (or whose
                # connection broke): sending it now would let its caller wait for another
                # whole timeout to learn the same.
                call.future.set_exception(
                    StoreUnavailable("redis unavailable: the batch ahead of this call failed")
                )
                continue
            batch.append(call)
        return batch

    async def _send(self, batch: list[_Call]) -> None:
        try:
            # One deadline for the whole batch, from when it is taken: connection, write,
            # replies, and a script reload if Redis lost the scripts.
            async with asyncio.timeout(self._timeout):
                replies = await self._execute(batch)
                lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
                if lost:
                    replies = await self._reload_and_retry(batch, replies, lost)
        except asyncio.CancelledError:
            self._fail(batch, StoreUnavailable("redis store closed"))
            raise
        except Exception as exc:
            # A timeout, a broken connection, a cluster without the slot's node: the whole
            # batch failed. Anything else (a bug) must not end the sender either, or callers
            # would wait for replies nobody sends; they get it as the store's error.
            self._failed_at = asyncio.get_running_loop().time()
            self._fail_with(batch, exc)
            return
        for call, reply in zip(batch, replies, strict=True):
            future = call.future
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(store_error(reply))
            else:
                future.set_result(reply)

    async def _execute(self, calls: Sequence[_Call]) -> list[Any]:
        """One pipeline of EVALSHAs: replies in call order, an error reply as its exception.

        The scripts are not registered with a redis-py pipeline: it would ask SCRIPT EXISTS
        before every execution, a second round trip. NOSCRIPT is handled instead.
        """
        self.stats.batches += 1
        self.stats.calls += len(calls)
        self.stats.largest = max(self.stats.largest, len(calls))
        commands = [("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args) for c in calls]
        return await self._transport.execute(commands, [c.future for c in calls])

    async def _reload_and_retry(
        self, batch: list[_Call], replies: list[Any], lost: list[int]
    ) -> list[Any]:
        """Redis restarted or its scripts were flushed: load what was missing, send again.

        SCRIPT LOAD goes through the client, which on a cluster sends it to every primary.
        A retried script runs once: NOSCRIPT means it did not run at all.
        """
        scripts = {id(batch[i].script): batch[i].script for i in lost}
        for script in scripts.values():
            await self._client.script_load(script.script)
        again = await self._execute([batch[i] for i in lost])
        replies = list(replies)
        for i, reply in zip(lost, again, strict=True):
            replies[i] = reply
        return replies

    @staticmethod
    def _fail(calls: Sequence[_Call] | deque[_Call], error: Exception) -> None:
        for call in calls:
            if not call.future.done():
                call.future.set_exception(StoreUnavailable(str(error)))

    @staticmethod
    def _fail_with(calls: Sequence[_Call], exc: BaseException) -> None:
        # One exception object per caller: a shared one would gather every caller's traceback.
        for call in calls:
            if not call.future.done():
                call.future.set_exception(store_error(exc))


Command = tuple[Any, ...]


class _Transport(Protocol):
    async def execute(
        self, commands: Sequence[Command], callers: Sequence[asyncio.Future[Any]]
    ) -> list[Any]:
        """The replies of ``commands`` in order. A transport may also hand reply i to
        ``callers[i]`` as soon as it is read (wire.py does); the pipeline answers the rest."""
        ...

    def forget(self) -> None:
        """Drop connections that belong to an event loop no longer running."""
        ...

    async def aclose(self) -> None: ...


class _Connections:
    """One server: connections of the pipeline's own, one per batch in flight.

    They are redis-py connections made like the client's (address, TLS, credentials,
    database, hiredis), driven directly: a batch is one packed write and a read per reply,
    without the pool's and the redis-py pipeline's bookkeeping, which cost more than the
    round trip itself. They have no socket timeout: the batch's deadline bounds them, and a
    socket timeout would cost a timer per reply and a task per write.
    """

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._idle: list[AbstractConnection] = []
        self._made: list[AbstractConnection] = []

    def _connection(self) -> AbstractConnection:
        if self._idle:
            return self._idle.pop()
        pool = self._pool
        conn: AbstractConnection = pool.connection_class(
            **{**pool.connection_kwargs, "socket_timeout": None}
        )
        self._made.append(conn)
        return conn

    async def execute(
        self, commands: Sequence[Command], callers: Sequence[asyncio.Future[Any]]
    ) -> list[Any]:
        conn = self._connection()
        try:
            return await self._exchange(conn, commands)
        except BaseException:
            # Replies may still be on the way (a deadline, a cancel): never reuse the socket.
            await conn.disconnect(nowait=True)
            raise
        finally:
            self._idle.append(conn)  # a disconnected one connects again on its next batch

    @staticmethod
    async def _exchange(conn: AbstractConnection, commands: Sequence[Command]) -> list[Any]:
        replies: list[Any] = []
        retried = False
        while True:
            # A connection that was open before this batch may have died since (a server
            # restart): that is worth one retry on a fresh one. A fresh connection failing
            # is Redis being down, reported at once.
            reused = conn.is_connected
            try:
                # hiredis packs in C, several times faster than redis-py's asyncio packer.
                packed = b"".join(map(hiredis.pack_command, commands[len(replies) :]))
                await conn.send_packed_command(packed)
                while len(replies) < len(commands):
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)  # this call's error; the stream stays in step
                return replies
            except RedisConnectionError:
                if retried or not reused:
                    raise
                retried = True
                # Only the calls without a reply are sent again. A script whose reply was
                # lost may have run; running it again is harmless (preflight reads, fill
                # writes only absent keys, postflight applies a record once).
                await conn.disconnect()

    def forget(self) -> None:
        self._made = []
        self._idle = []

    async def aclose(self) -> None:
        for conn in self._made:
            await conn.disconnect(nowait=True)
        self.forget()


class _ClusterPipelines:
    """A cluster: redis-py's cluster pipeline splits a batch by node (every key of one call
    carries the team's hash tag, so a call has one node), runs the nodes' pipelines
    concurrently and follows MOVED and ASK."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client

    async def execute(
        self, commands: Sequence[Command], callers: Sequence[asyncio.Future[Any]]
    ) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies = list(await pipe.execute(raise_on_error=False))
        # Without raise_on_error the cluster pipeline hands a node's broken connection back
        # as each call's reply instead of retrying. Those calls go once more through the
        # client's own command path, which reconnects, refreshes the slot map after a
        # failover and retries as redis-py does for any command.
        retry = RedisCluster.ERRORS_ALLOW_RETRY
        broken = [i for i, reply in enumerate(replies) if isinstance(reply, retry)]
        if broken:
            again = await asyncio.gather(
                *(self._client.execute_command(*commands[i]) for i in broken),
                return_exceptions=True,
            )
            for i, reply in zip(broken, again, strict=True):
                replies[i] = reply
        return replies

    def forget(self) -> None:
        pass  # its connections are the client's

    async def aclose(self) -> None:
        pass
