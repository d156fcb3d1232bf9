"""The ASGI lifespan, with spendguard's background tasks started and stopped inside it.

Adding the middleware is enough: the record writer and the settlement worker start when the
app reports started and stop (records flushed) before it reports shut down. An app that does
not speak lifespan (it raises, or returns without answering) gets the protocol run by
spendguard itself, so the worker runs all the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from anyio.abc import TaskGroup
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.guard import SpendGuard
from ..errors import SpendGuardError

log = logging.getLogger("spendguard")


async def run_lifespan(
    app: ASGIApp,
    guard: SpendGuard,
    scope: Scope,
    receive: Receive,
    send: Send,
    started: Callable[[], None] | None = None,
) -> None:
    """``started`` runs once the app's own startup is done (its routes may have changed), and
    before the guard starts: what it reads from the app (a router's model names) then prices
    the settlement worker's first pass too."""
    seen = {"startup": False, "answered": False, "failed": False}
    async with anyio.create_task_group() as tg:

        async def lifespan_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                seen["startup"] = True
            return message

        async def lifespan_send(message: Message) -> None:
            if seen["failed"]:
                # The server was told start-up failed and is exiting: what the app says as it
                # is torn down (Starlette's "shutdown failed" with its traceback) is noise.
                return
            if message["type"] == "lifespan.startup.complete":
                seen["answered"] = True
                if started is not None:
                    started()
                if not await _start(guard, tg, send):
                    seen["failed"] = True
                    return
            elif message["type"] == "lifespan.startup.failed":
                seen["answered"] = True
            elif message["type"] == "lifespan.shutdown.complete":
                await guard.stop()
            await send(message)

        try:
            await app(scope, lifespan_receive, lifespan_send)
        except Exception:
            if seen["answered"]:
                raise
            log.info("the app does not handle ASGI lifespan; spendguard runs it itself")
        try:
            if not seen["answered"]:
                await _own_lifespan(guard, tg, seen["startup"], receive, send, started)
        finally:
            if guard.running:
                await guard.stop()


async def _start(guard: SpendGuard, tg: TaskGroup, send: Send) -> bool:
    try:
        await guard.start(task_group=tg)
        return True
    except Exception as exc:
        if isinstance(exc, SpendGuardError):
            # An outage or a setting, named in its message (the database down, a bad URL):
            # one line says it all, where a traceback would bury it.
            log.error("spendguard cannot start: %s", exc)
        else:  # a bug: the traceback is what its report needs
            log.exception("spendguard failed to start")
        await send({"type": "lifespan.startup.failed", "message": f"spendguard: {exc}"})
        return False


async def _own_lifespan(
    guard: SpendGuard,
    tg: TaskGroup,
    got_startup: bool,
    receive: Receive,
    send: Send,
    started: Callable[[], None] | None,
) -> None:
    if not got_startup:
        await receive()  # lifespan.startup
    if started is not None:
        started()
    if not await _start(guard, tg, send):
        return
    await send({"type": "lifespan.startup.complete"})
    while (await receive())["type"] != "lifespan.shutdown":
        pass
    await guard.stop()
    await send({"type": "lifespan.shutdown.complete"})
