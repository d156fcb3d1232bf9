"""A loopback TCP proxy a test can cut: the database "goes down" without touching the server.

``down()`` closes the listener and every open connection (new connections are refused, pooled
ones break); ``up()`` listens again on the same port.

It also counts round trips on the wire (``rounds``): a round starts when a client sends after
a server answered (or first), on any connection through proxies sharing one :class:`Rounds`.
Writes to several servers before any of them answers (a cluster's pipelines, sent in
parallel) are one round: the client waits for one round trip, not for each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import anyio
from anyio.abc import SocketStream, TaskGroup

from .ports import HOST, free_port


class Rounds:
    """Sequential round trips seen by the proxies that share this counter, and which proxies
    (a Cluster's nodes) each round wrote to."""

    def __init__(self) -> None:
        self.nodes: list[set[object]] = []  # per round, the proxies it wrote to
        self._answered = True  # nothing in flight: the next client write starts a round

    @property
    def count(self) -> int:
        return len(self.nodes)

    def sent(self, via: object = None) -> None:
        if self._answered:
            self._answered = False
            self.nodes.append(set())
        self.nodes[-1].add(via)

    def answered(self) -> None:
        self._answered = True


class TcpProxy:
    def __init__(
        self, target_port: int, *, target_host: str = HOST, rounds: Rounds | None = None
    ) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.rounds = rounds if rounds is not None else Rounds()
        self._scope: anyio.CancelScope | None = None
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> TcpProxy:
        self._tg = await anyio.create_task_group().__aenter__()
        await self.up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.down()
        assert self._tg is not None
        await self._tg.__aexit__(None, None, None)

    async def up(self) -> None:
        assert self._tg is not None
        listener = await anyio.create_tcp_listener(
            local_host=HOST, local_port=self.port, reuse_port=False
        )
        scope = anyio.CancelScope()
        self._scope = scope

        async def serve() -> None:
            with scope:
                async with listener, anyio.create_task_group() as conns:
                    await listener.serve(self._pipe, task_group=conns)

        self._tg.start_soon(serve)

    def down(self) -> None:
        if self._scope is not None:
            self._scope.cancel()  # closes the listener and every piped connection
            self._scope = None

    async def _pipe(self, client: SocketStream) -> None:
        async with client:
            try:
                upstream = await anyio.connect_tcp(*self.target)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:

                async def copy(
                    src: SocketStream, dst: SocketStream, note: Callable[[], None]
                ) -> None:
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        while True:
                            data = await src.receive()
                            note()
                            await dst.send(data)
                    tg.cancel_scope.cancel()

                tg.start_soon(copy, client, upstream, partial(self.rounds.sent, self))
                tg.start_soon(copy, upstream, client, self.rounds.answered)
