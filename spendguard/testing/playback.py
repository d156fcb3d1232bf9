"""Playing a :class:`Script` over ASGI, stalling or cutting it where the options say."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .scripts import Script


class UpstreamAborted(RuntimeError):
    """Raised inside the fake on purpose (``stop_after``) so the server aborts the connection.

    Through ``httpx.ASGITransport`` it surfaces in the client as this exception; behind a real
    server (uvicorn) the client sees the connection close before the body ended.
    """


async def _wait_for_disconnect(receive: Receive) -> None:
    # The request body was read already, so the next message is the disconnect. Through
    # httpx.ASGITransport it never comes while the response is unfinished: the stall then lasts
    # until the caller cancels, which is what a hung provider looks like.
    while (await receive())["type"] != "http.disconnect":
        pass


class ScriptedResponse(Response):
    """A 200 response that sends ``script``, or fails part-way through it.

    ``stall_after=N`` stops after N content chunks and waits for the client to leave;
    ``stop_after=N`` raises :class:`UpstreamAborted` there instead; ``None`` means never.
    """

    def __init__(self, script: Script, *, stall_after: int | None, stop_after: int | None) -> None:
        self.status_code = 200
        self.media_type = script.media_type
        self.background = None
        self.raw_headers = [
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in script.headers.items()),
            (b"content-type", script.media_type.encode("latin-1")),
        ]
        self._script = script
        # Whichever failure comes first wins; on a tie the abrupt end does.
        self._stop = stop_after is not None and (stall_after is None or stop_after <= stall_after)
        self._cut = stop_after if self._stop else stall_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        script, cut = self._script, self._cut
        parts = (*script.prelude, *script.deltas, *script.epilogue)
        if cut is not None and not script.streaming:
            await self._fail_whole_body(parts[0], receive, send)
            return
        # Cut before the (cut+1)-th delta, or before the epilogue when there are fewer deltas:
        # a cut stream never reaches its finish/usage frames.
        stop_at = len(parts) if cut is None else len(script.prelude) + min(cut, len(script.deltas))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for part in parts[:stop_at]:
                await send({"type": "http.response.body", "body": part, "more_body": True})
            if cut is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        except OSError:
            # ASGI 2.4 servers raise OSError from send() once the client is gone. A real
            # provider just stops generating; so does the fake, without an error log per drop.
            return
        if self._stop:
            raise UpstreamAborted(f"fake upstream cut the stream after {cut} content chunks")
        await _wait_for_disconnect(receive)

    async def _fail_whole_body(self, payload: bytes, receive: Receive, send: Send) -> None:
        if not self._stop:
            # A stalled non-streaming answer: no status, no headers, nothing.
            await _wait_for_disconnect(receive)
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            head = payload[: len(payload) // 2]
            await send({"type": "http.response.body", "body": head, "more_body": True})
        except OSError:
            return
        raise UpstreamAborted("fake upstream cut the response body in half")
