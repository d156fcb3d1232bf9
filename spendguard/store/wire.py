"""The hot path's own connections to one Redis server: RESP over an asyncio protocol.

A batch of script calls is one ``write`` of commands packed by hiredis; the replies are parsed
by hiredis as their bytes arrive, in ``data_received``, and handed over through one future per
batch. redis-py's connection reads through a stream reader with one await per reply, which
costs more than the round trip itself at one request at a time (the benchmarks' "Redis client
path" measures both in the same run); everything else (admin, fills of policies, cache sync)
stays on redis-py.

Only what a plain TCP or Unix-socket connection needs is spoken here: AUTH, SELECT and CLIENT
SETNAME at connect. A client with TLS, a credential provider or RESP3 keeps redis-py's
connections (:func:`supports`).

Nothing here depends on which event loop runs it: the protocol keeps only the two methods it
calls on its transport (:class:`_Transport`), which every loop's stream transports have, and
only the loop's public API is used (uvloop's transports and handles are not asyncio's classes).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

__all__ = ["Broken", "WireConnections", "WireProtocol", "plain", "supports"]

Command = tuple[Any, ...]


def supports(client: Redis) -> bool:
    """Whether ``client``'s connections are ones this module can make itself."""
    pool = client.connection_pool
    return pool.connection_class in (Connection, UnixDomainSocketConnection) and plain(
        pool.connection_kwargs
    )


def plain(kwargs: Mapping[str, Any]) -> bool:
    """Whether connections made with ``kwargs`` need nothing this module does not speak (no
    TLS, no credential provider, RESP2, decoded replies)."""
    return (
        not kwargs.get("ssl")
        and kwargs.get("connection_class") in (None, Connection)
        and kwargs.get("credential_provider") is None
        and kwargs.get("protocol") in (None, 2, "2")
        and bool(kwargs.get("decode_responses"))
    )


def _reply_error(message: str) -> ResponseError:
    # What redis-py's parser makes of it: the pipeline reloads scripts on NoScriptError.
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message.removeprefix("NOSCRIPT "))
    return ResponseError(message)


class Broken(RedisConnectionError):
    """The connection failed in the middle of a batch; ``replies`` had arrived before."""

    def __init__(self, message: str, replies: list[Any]) -> None:
        super().__init__(message)
        self.replies = replies


class _Transport(Protocol):
    """What a connection uses of its transport. An ``isinstance`` check against asyncio's own
    classes would refuse other loops' transports (uvloop's are no subclass of them)."""

    def write(self, data: bytes) -> None: ...

    def abort(self) -> None: ...


class _Batch:
    __slots__ = ("callers", "future", "replies", "wanted")

    def __init__(
        self,
        future: asyncio.Future[list[Any]],
        wanted: int,
        callers: Sequence[asyncio.Future[Any]] | None,
    ) -> None:
        self.future, self.wanted, self.callers = future, wanted, callers
        self.replies: list[Any] = []


class WireProtocol(asyncio.Protocol):
    """One connection: batches written in order, their replies read in the same order."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(encoding="utf-8", replyError=_reply_error)
        self._batches: deque[_Batch] = deque()
        self._transport: _Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport, whatever loop made it (see the module docstring).
        self._transport = cast(_Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reason = f"connection lost: {exc!r}" if exc is not None else "connection closed"
        while self._batches:
            batch = self._batches.popleft()
            if not batch.future.done():
                batch.future.set_exception(Broken(reason, batch.replies))

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        batches = self._batches
        while batches:
            reply = reader.gets()
            if reply is False:  # incomplete: more bytes to come
                return
            batch = batches[0]
            if batch.callers is not None and not isinstance(reply, Exception):
                # A caller waiting for this reply has it now, in this loop turn, rather than
                # after the batch's sender wakes and hands it over (an error reply is the
                # sender's to translate, or to retry after a script reload).
                caller = batch.callers[len(batch.replies)]
                if not caller.done():
                    caller.set_result(reply)
            batch.replies.append(reply)
            if len(batch.replies) == batch.wanted:
                batches.popleft()
                if not batch.future.done():
                    batch.future.set_result(batch.replies)
        if reader.gets() is not False:
            # A reply nobody asked for: the stream is out of step, nothing read from it
            # further can be trusted.
            self.close()

    def exchange(
        self,
        packed: bytes,
        wanted: int,
        callers: Sequence[asyncio.Future[Any]] | None = None,
    ) -> asyncio.Future[list[Any]]:
        """Write ``wanted`` packed commands; the future gets their replies, in order, and
        ``callers[i]`` (if given) gets reply i as soon as it is read, unless it is an error."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if self.closed or self._transport is None:
            future.set_exception(Broken("connection closed", []))
            return future
        self._batches.append(_Batch(future, wanted, callers))
        self._transport.write(packed)
        return future

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.abort()  # replies still on the way must never reach a new batch
        self.closed = True
        # The batches it carried end now, not a loop turn later when the transport reports
        # the connection lost.
        self.connection_lost(None)


class WireConnections:
    """One server, connections of the pipeline's own, one per batch in flight (the interface
    of ``pipeline._Connections``: ``execute``, ``forget``, ``aclose``)."""

    def __init__(self, client: Redis) -> None:
        self._made_from(client.connection_pool.connection_kwargs)

    @classmethod
    def at(cls, host: str, port: int, kwargs: Mapping[str, Any]) -> WireConnections:
        """Connections to ``host:port`` with the credentials of ``kwargs`` (a cluster node)."""
        conns = cls.__new__(cls)
        conns._made_from({**kwargs, "host": host, "port": port, "path": None})
        return conns

    def _made_from(self, kwargs: Mapping[str, Any]) -> None:
        self._path: str | None = kwargs.get("path")
        self._host: str = kwargs.get("host") or "localhost"
        self._port = int(kwargs.get("port") or 6379)
        setup: list[Command] = []
        password, username = kwargs.get("password"), kwargs.get("username")
        if password is not None:
            setup.append(("AUTH", username, password) if username else ("AUTH", password))
        if int(kwargs.get("db") or 0) != 0:
            setup.append(("SELECT", int(kwargs["db"])))
        if kwargs.get("client_name"):
            setup.append(("CLIENT", "SETNAME", kwargs["client_name"]))
        self._setup = setup
        self._idle: list[WireProtocol] = []
        self._made: set[WireProtocol] = set()

    async def _connect(self) -> WireProtocol:
        loop = asyncio.get_running_loop()
        if self._path is not None:
            _, proto = await loop.create_unix_connection(WireProtocol, self._path)
        else:
            _, proto = await loop.create_connection(WireProtocol, self._host, self._port)
        self._made.add(proto)
        if self._setup:
            packed = b"".join(map(hiredis.pack_command, self._setup))
            try:
                replies = await proto.exchange(packed, len(self._setup))
            except BaseException:
                self.drop(proto)
                raise
            for reply in replies:
                if isinstance(reply, Exception):
                    self.drop(proto)
                    raise RedisConnectionError(f"redis refused the connection setup: {reply}")
        return proto

    def drop(self, conn: WireProtocol | None) -> None:
        if conn is not None:
            conn.close()
            self._made.discard(conn)

    def ready(self) -> WireProtocol | None:
        """An open connection no batch is using, taken for one; None if there is none (a
        batch must then connect, awaiting, in ``execute``)."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            self._made.discard(conn)
        return None

    def release(self, conn: WireProtocol) -> None:
        """``conn`` (from ``ready``) carried its batch to the end: it takes the next."""
        self._idle.append(conn)

    async def execute(
        self,
        commands: Sequence[Command],
        callers: Sequence[asyncio.Future[Any]],
        *,
        fresh: bool = False,
    ) -> list[Any]:
        """The replies of ``commands``, in order; ``callers[i]`` gets reply i early (above).
        ``fresh``: on a new connection (an open one just broke under these calls)."""
        replies: list[Any] = []
        retried = False
        conn = self.ready() if not fresh else None
        while True:
            # A connection that was open before this batch may have died since (a server
            # restart): that is worth one retry on a fresh one. A fresh connection failing
            # is Redis being down, reported at once.
            reused = conn is not None and not conn.closed
            try:
                if conn is None or not reused:
                    self.drop(conn)
                    conn = None
                    conn = await self._connect()
                done = len(replies)
                rest = commands[done:]
                packed = b"".join(map(hiredis.pack_command, rest))
                got = await conn.exchange(packed, len(rest), callers[done:])
            except Broken as exc:
                replies.extend(exc.replies)
                self.drop(conn)
                if retried or not reused:
                    raise
                retried = True
                # Only the calls without a reply are sent again. A script whose reply was
                # lost may have run; running it again is harmless (preflight reads, fill
                # writes only absent keys, postflight applies a record once).
                conn = None
                continue
            except BaseException:
                # Replies may still be on the way (a deadline, a cancel): never reuse it.
                self.drop(conn)
                raise
            self.release(conn)
            return replies + got if replies else got

    def forget(self) -> None:
        self._made = set()
        self._idle = []

    async def aclose(self) -> None:
        for conn in list(self._made):
            conn.close()
        self.forget()
