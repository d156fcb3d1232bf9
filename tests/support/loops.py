"""The event loops the tests run on: asyncio's own, and uvloop, which uvicorn picks by default
wherever it is installed. Their transports, handles and clocks are different classes with
different timing, so the code that talks to sockets (the Redis store's wire connections) is
tested on both."""

from __future__ import annotations

from typing import Any

LOOPS = ("asyncio", "uvloop")


def anyio_backend(loop: str) -> str | tuple[str, dict[str, Any]]:
    """The value of anyio's ``anyio_backend`` fixture that runs a test on ``loop``."""
    if loop == "asyncio":
        return "asyncio"
    if loop == "uvloop":
        import uvloop

        return ("asyncio", {"loop_factory": uvloop.new_event_loop})
    raise ValueError(f"unknown event loop {loop!r}, not one of {LOOPS}")


def running_loop_name() -> str:
    """Which of :data:`LOOPS` runs the calling coroutine (a test asserts it got the one it
    was parametrized with, rather than trusting the plugin)."""
    import asyncio

    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.split(".")[0] == "uvloop" else "asyncio"
