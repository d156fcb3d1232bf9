"""Concurrent script calls, coalesced into pipelines (design.md, "The Redis store").

Every hot-path decision is one EVALSHA. Sent one by one, each costs a pooled connection, a
round trip of its own and redis-py's per-command overhead, and under load the pool serialises
them. Here the calls that requests make in the same event-loop turn, or while earlier batches
are in flight, leave as one non-transactional pipeline: one write, one round trip, replies in
order. Each caller still gets its own reply or its own error; a script that refuses its input
fails only its caller.

The deadline is one per batch and starts when the batch is taken for sending, so it measures
Redis (and the connection), not how long a request waited for the event loop. A call never
waits for long in the queue either: it is queued only while as many batches as may be in
flight are, and when a batch fails (its deadline, a broken connection) the calls queued behind
it fail with it instead of being sent to a Redis that just did not answer. So a call ends
within about twice the timeout however Redis fails, and a slow event loop alone never fails
one.

On an open connection to one server a batch needs no task: the flush writes it, the replies
resolve their callers as they are read (wire.py), a loop timer is its deadline and a callback
its end. Only a batch that must await (connecting, a script reload, a cluster, redis-py's
connections) runs in a task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import anyio
import hiredis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
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
class _Landing:
    """A batch written in parts (one per cluster node; one on a single server): how many have
    yet to end, and the epoch it was sent in."""

    left: int
    epoch: int


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
        # The one-server connections of wire.py can take a batch without a task (see _flush).
        self._wire: wire.WireConnections | None = None
        # A cluster on wire connections: a batch goes to its nodes without a task, likewise.
        self._nodes: _ClusterWire | None = None
        if isinstance(client, RedisCluster):
            cluster = _ClusterPipelines(client)
            plain = wire.plain(client.get_connection_kwargs())
            if plain:
                self._transport = self._nodes = _ClusterWire(client, cluster)
            else:
                self._transport = cluster
        elif wire.supports(client):
            self._transport = self._wire = wire.WireConnections(client)
        else:  # TLS, a credential provider, RESP3: redis-py's own connections
            self._transport = _Connections(client)
        self._timeout = timeout
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._queue: deque[_Call] = deque()
        self._busy = 0  # batches in flight
        # The flush queued for the next loop turn: it takes everything queued by then, so the
        # calls of one loop turn leave together.
        self._flushing: asyncio.Handle | None = None
        # Batches that need awaiting (connecting, a cluster, a script reload): one task each.
        self._tasks: set[asyncio.Task[None]] = set()
        # When a batch last failed as a whole: calls queued before then are not sent.
        self._failed_at = float("-inf")
        # Counts closes and loop changes: a batch of an earlier epoch ends without touching
        # the count of batches in flight, which started afresh.
        self._epoch = 0
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
        if self._flushing is None and self._busy < self._max_in_flight:
            self._flushing = loop.call_soon(self._flush)
        return future

    async def aclose(self) -> None:
        """Stop every batch and fail what is still queued (the store is closing; used again,
        it connects again)."""
        self._epoch += 1
        self._busy = 0
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail(self._queue, StoreUnavailable("redis store closed"))
        self._queue.clear()
        # Batches in flight on wire connections fail as their connections close.
        await self._transport.aclose()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start afresh in another event loop (a store used by one ``asyncio.run`` after
        another): a batch of the old loop may never end, and would hold its place."""
        self._loop = loop
        self._queue.clear()  # callers of a finished loop wait no more
        self._epoch += 1
        self._busy = 0
        self._flushing = None
        self._tasks = set()
        self._failed_at = float("-inf")
        self._transport.forget()

    # -- sending ----------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send what is queued, as batches, while a batch may start.

        On an open wire connection a batch is written here, at once: its replies resolve the
        callers as they are read (wire.py) and a timer is its deadline, so a warm call costs
        no task, no cancel scope and no wake-up of a sender. A batch that must await first
        (no open connection yet, a cluster, redis-py's connections) runs in a task.
        """
        self._flushing = None
        queue = self._queue
        while queue and self._busy < self._max_in_flight:
            batch = self._take()
            if not batch:
                return
            self._busy += 1
            parts = self._ready_parts(batch)
            if parts is None:
                self._in_task(self._send(batch))
                continue
            self._counted(batch)
            landing = _Landing(len(parts), self._epoch)
            for conns, conn, part in parts:
                try:
                    self._write(part, conns, conn, landing)
                except Exception as exc:  # nothing was written (packing failed): a bug
                    conns.release(conn)
                    self._fail_with(part, exc)
                    self._part_ended(landing)

    def _ready_parts(
        self, batch: list[_Call]
    ) -> list[tuple[wire.WireConnections, wire.WireProtocol, list[_Call]]] | None:
        """Where each part of ``batch`` can be written at once: the one server's open
        connection, or each cluster node's (the calls grouped by their keys' node); None when
        a part would have to await (no open connection yet, an unknown slot map)."""
        if self._wire is not None:
            conn = self._wire.ready()
            return None if conn is None else [(self._wire, conn, batch)]
        nodes = self._nodes
        if nodes is None:
            return None
        groups = nodes.group(batch)
        if groups is None:
            return None
        parts: list[tuple[wire.WireConnections, wire.WireProtocol, list[_Call]]] = []
        for conns, calls in groups:
            conn = conns.ready()
            if conn is None:
                for taken, held, _ in parts:
                    taken.release(held)
                return None
            parts.append((conns, conn, calls))
        return parts

    def _part_ended(self, landing: _Landing) -> None:
        """One part of a batch is over; the batch is, once every part is."""
        landing.left -= 1
        if landing.left == 0 and landing.epoch == self._epoch:
            self._ended()

    def _ended(self) -> None:
        """A batch is over: what queued meanwhile leaves now."""
        self._busy -= 1
        if self._queue and self._flushing is None:
            self._flush()

    def _in_task(self, work: Coroutine[Any, Any, None], landing: _Landing | None = None) -> None:
        """Run ``work`` (a batch, or a part of one, ``landing``) in a task; the batch is over
        when it ends."""
        landing = landing or _Landing(1, self._epoch)
        task = asyncio.get_running_loop().create_task(self._until_ended(work, landing))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _until_ended(self, work: Coroutine[Any, Any, None], landing: _Landing) -> None:
        try:
            await work
        finally:
            self._part_ended(landing)

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

    def _counted(self, calls: Sequence[_Call]) -> None:
        """One pipeline sent (its parts to a cluster's nodes go in parallel: one)."""
        self.stats.batches += 1
        self.stats.calls += len(calls)
        self.stats.largest = max(self.stats.largest, len(calls))

    @staticmethod
    def _commands(calls: Sequence[_Call]) -> list[Command]:
        return [("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args) for c in calls]

    def _write(
        self,
        batch: list[_Call],
        conns: wire.WireConnections,
        conn: wire.WireProtocol,
        landing: _Landing,
    ) -> None:
        """Write ``batch`` (or a part of one) on an open connection of ``conns``; ``_landed``
        takes it from there."""
        loop = asyncio.get_running_loop()
        packed = b"".join(map(hiredis.pack_command, self._commands(batch)))
        replies = conn.exchange(packed, len(batch), [c.future for c in batch])
        deadline = loop.call_at(loop.time() + self._timeout, _expire, replies)
        replies.add_done_callback(partial(self._landed, landing, batch, conns, conn, deadline))

    def _landed(
        self,
        landing: _Landing,
        batch: list[_Call],
        conns: wire.WireConnections,
        conn: wire.WireProtocol,
        deadline: asyncio.TimerHandle,
        replies: asyncio.Future[list[Any]],
    ) -> None:
        """A written batch's replies are in, or its connection broke, or its deadline passed."""
        deadline.cancel()
        try:
            self._land(landing, batch, conns, conn, replies)
        except Exception as exc:
            # A bug here must not leave callers waiting for replies nobody hands over, nor
            # hold the batch's place: they get it as the store's error.
            self._fail_with(batch, exc)
            self._part_ended(landing)

    def _land(
        self,
        landing: _Landing,
        batch: list[_Call],
        conns: wire.WireConnections,
        conn: wire.WireProtocol,
        replies: asyncio.Future[list[Any]],
    ) -> None:
        if landing.epoch != self._epoch or replies.cancelled():  # the store closed meanwhile
            conns.drop(conn)
            self._fail(batch, StoreUnavailable("redis store closed"))
            return
        exc = replies.exception()
        if exc is None:
            conns.release(conn)
            got = replies.result()
            if any(
                isinstance(reply, NoScriptError) or (self._nodes is not None and _redirected(reply))
                for reply in got
            ):
                # A reload, or a slot that moved, must await: in a task, which sends those
                # calls again (a redirection through redis-py's cluster pipeline).
                self._in_task(self._send(batch, got), landing)
                return
            self._answer(batch, got)
        elif isinstance(exc, wire.Broken):
            # A connection that was open before this batch died on it (a server restart):
            # the calls without a reply go once more, on a fresh connection.
            conns.drop(conn)
            done = len(exc.replies)
            self._answer(batch[:done], exc.replies)
            if done < len(batch):
                self._in_task(self._send(batch[done:], fresh=True), landing)
                return
        else:
            conns.drop(conn)
            self._failed_at = asyncio.get_running_loop().time()
            self._fail_with(batch, exc)
        self._part_ended(landing)

    async def _send(
        self, batch: list[_Call], replies: list[Any] | None = None, *, fresh: bool = False
    ) -> None:
        """Send ``batch`` through the transport, awaiting (``replies``: it was sent already, and
        only its lost scripts are to be sent again)."""
        try:
            # One deadline for the whole batch, from when it is taken: connection, write,
            # replies, and a script reload if Redis lost the scripts.
            async with asyncio.timeout(self._timeout):
                if replies is None:
                    replies = await self._execute(batch, fresh=fresh)
                lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
                if lost:
                    replies = await self._reload_and_retry(batch, replies, lost)
                moved = [i for i, reply in enumerate(replies) if _redirected(reply)]
                if moved and self._nodes is not None:  # written directly to a former owner
                    replies = list(replies)
                    redone = await self._execute([batch[i] for i in moved])
                    for i, reply in zip(moved, redone, strict=True):
                        replies[i] = reply
        except asyncio.CancelledError:
            self._fail(batch, StoreUnavailable("redis store closed"))
            raise
        except Exception as exc:
            # A timeout, a broken connection, a cluster without the slot's node: the whole
            # batch failed. Anything else (a bug) must not end the pipeline either, or callers
            # would wait for replies nobody sends; they get it as the store's error.
            self._failed_at = asyncio.get_running_loop().time()
            self._fail_with(batch, exc)
            return
        self._answer(batch, replies)

    def _answer(self, batch: Sequence[_Call], replies: Sequence[Any]) -> None:
        for call, reply in zip(batch, replies, strict=True):
            future = call.future
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(store_error(reply))
            else:
                future.set_result(reply)

    async def _execute(self, calls: Sequence[_Call], *, fresh: bool = False) -> list[Any]:
        """One pipeline of EVALSHAs: replies in call order, an error reply as its exception.

        The scripts are not registered with a redis-py pipeline: it would ask SCRIPT EXISTS
        before every execution, a second round trip. NOSCRIPT is handled instead.
        """
        self._counted(calls)
        commands = self._commands(calls)
        callers = [c.future for c in calls]
        if fresh and self._wire is not None:
            return await self._wire.execute(commands, callers, fresh=True)
        return await self._transport.execute(commands, callers)

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


def _expire(replies: asyncio.Future[list[Any]]) -> None:
    """A written batch's deadline: its replies did not all come in time."""
    if not replies.done():
        replies.set_exception(TimeoutError("no reply from redis within the timeout"))


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


# A node's answer that means "not here, or not now": the call goes through redis-py, which
# refreshes its slot map and follows the redirection.
_REDIRECTED = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")


def _redirected(reply: Any) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith(_REDIRECTED)


class _ClusterWire:
    """A cluster on the pipeline's own connections (wire.py), one set per node: each call goes
    to the primary that holds its keys' slot (every key of a call shares one hash tag), one
    packed write per node, the nodes in parallel. redis-py's cluster pipeline does the same at
    several times the CPU per call.

    What redis-py knows better stays with it: the slot map (read from its client, which loads
    it on its first command), and every call a node answers MOVED, ASK, TRYAGAIN or
    CLUSTERDOWN, or whose node can't be reached (a failover, a resharding): those go once
    more through its cluster pipeline (``fallback``), which refreshes the map and follows
    redirections. So does a batch sent before the map is known."""

    def __init__(self, client: RedisCluster, fallback: _ClusterPipelines) -> None:
        self._client = client
        self._fallback = fallback
        self._kwargs = client.get_connection_kwargs()
        self._nodes: dict[tuple[str, int], wire.WireConnections] = {}

    def _node(self, host: str, port: int) -> wire.WireConnections:
        conns = self._nodes.get((host, port))
        if conns is None:
            conns = self._nodes[(host, port)] = wire.WireConnections.at(host, port, self._kwargs)
        return conns

    def _by_node(self, keys: Sequence[str]) -> dict[tuple[str, int], list[int]] | None:
        """The indexes of ``keys`` (each a call's first key: every key of a call shares its
        slot) by the address of the primary holding their slot; None when the slot map is not
        known (yet) or no node covers a slot (redis-py finds out)."""
        nodes = self._client.nodes_manager
        if not nodes.slots_cache:
            return None
        groups: dict[tuple[str, int], list[int]] = {}
        try:
            for i, key in enumerate(keys):
                node = nodes.get_node_from_slot(key_slot(key.encode()))
                groups.setdefault((node.host, int(node.port)), []).append(i)
        except RedisError:
            return None
        return groups

    def group(
        self, batch: Sequence[_Call]
    ) -> list[tuple[wire.WireConnections, list[_Call]]] | None:
        """``batch``'s calls by their node, with that node's connections (None: see
        ``_by_node``)."""
        groups = self._by_node([call.keys[0] for call in batch])
        if groups is None:
            return None
        return [
            (self._node(*address), [batch[i] for i in calls]) for address, calls in groups.items()
        ]

    async def execute(
        self, commands: Sequence[Command], callers: Sequence[asyncio.Future[Any]]
    ) -> list[Any]:
        # EVALSHA sha numkeys key ...: a call's slot is its first key's.
        groups = self._by_node([str(command[3]) for command in commands])
        if groups is None:
            return await self._fallback.execute(commands, callers)
        replies: list[Any] = [None] * len(commands)
        again: list[int] = []

        async def send(address: tuple[str, int], calls: list[int]) -> None:
            try:
                got = await self._node(*address).execute(
                    [commands[i] for i in calls], [callers[i] for i in calls]
                )
            except (RedisConnectionError, OSError):
                again.extend(i for i in calls if not callers[i].done())
                return
            for i, reply in zip(calls, got, strict=True):
                if _redirected(reply):
                    again.append(i)
                else:
                    replies[i] = reply

        if len(groups) == 1:
            await send(*next(iter(groups.items())))
        else:
            await asyncio.gather(*(send(address, calls) for address, calls in groups.items()))
        if again:
            again.sort()
            redone = await self._fallback.execute(
                [commands[i] for i in again], [callers[i] for i in again]
            )
            for i, reply in zip(again, redone, strict=True):
                replies[i] = reply
        return replies

    def forget(self) -> None:
        for conns in self._nodes.values():
            conns.forget()
        self._nodes = {}

    async def aclose(self) -> None:
        for conns in self._nodes.values():
            await conns.aclose()
        self._nodes = {}
