"""The fake provider app: routing, request checks, options, and which answer each request gets.

The answer's bytes come from :mod:`.scripts` (or :mod:`.error_responses`); :mod:`.playback`
sends them, stalling or cutting them as the options say.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .error_responses import error_response
from .options import Options, options_for
from .playback import ScriptedResponse
from .routes import ROUTES, Kind
from .scripts import SCRIPTS, Plan
from .tokens import expected_usage, word_count, words

_RECEIVED_LIMIT: Final = 1000

_RESPONSE_ID_PREFIXES: Final[Mapping[Kind, str]] = {
    "chat": "chatcmpl-",
    "completions": "cmpl-",
    "responses": "resp_",
    "embeddings": "emb-",
    "messages": "msg_",
}


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    """One request as the fake received it, for asserting what the gateway forwarded."""

    path: str
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class FakeUpstream(Starlette):
    """The fake provider: ``received`` keeps the last 1000 requests, ``request_count`` all."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.received: deque[ReceivedRequest] = deque(maxlen=_RECEIVED_LIMIT)
        self.request_count = 0
        self._ids = itertools.count(1)
        super().__init__(
            routes=[
                Route(path, self._endpoint(path, kind), methods=["POST"])
                for path, kind in ROUTES.items()
            ]
        )

    def _endpoint(self, path: str, kind: Kind) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await self._handle(request, path, kind)

        return endpoint

    async def _handle(self, request: Request, path: str, kind: Kind) -> Response:
        serial = next(self._ids)
        request_id = f"req_fake{serial:012d}"
        raw = await request.body()
        self.request_count += 1
        self.received.append(ReceivedRequest(path, dict(request.headers), raw))
        try:
            options = options_for(self.options, request.headers)
        except ValueError as exc:
            return error_response(kind, 400, str(exc), request_id)
        if options.delay > 0:
            await anyio.sleep(options.delay)
        if options.fail_status is not None:
            message = f"Simulated upstream error {options.fail_status} (spendguard.testing)."
            return error_response(kind, options.fail_status, message, request_id)

        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return error_response(kind, 400, "The request body is not valid JSON.", request_id)
        if not isinstance(body, dict):
            return error_response(kind, 400, "The request body must be a JSON object.", request_id)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return error_response(kind, 400, "model: a model name is required.", request_id)
        if not _is_utf8_text(model):  # a lone surrogate (JSON allows the escape): as a provider
            return error_response(kind, 400, "model: not a valid model name.", request_id)
        if kind == "embeddings" and not body.get("input"):
            return error_response(kind, 400, "input: a non-empty input is required.", request_id)

        count = word_count(kind, body, options.chunks)
        plan = Plan(
            kind=kind,
            body=body,
            model=model,
            stream=kind != "embeddings" and body.get("stream") is True,
            words=tuple(words(count)),
            usage=expected_usage(
                path, body, chunks=options.chunks, output_tokens=options.output_tokens
            ),
            truncated=count < options.chunks,
            report_usage=options.report_usage,
            request_id=request_id,
            response_id=f"{_RESPONSE_ID_PREFIXES[kind]}fake{serial:012d}",
            created=int(time.time()),
        )
        return ScriptedResponse(
            SCRIPTS[kind](plan), stall_after=options.stall_after, stop_after=options.stop_after
        )


def fake_upstream(
    *,
    report_usage: bool = True,
    fail_status: int | None = None,
    stall_after: int | None = None,
    stop_after: int | None = None,
    chunks: int = 5,
    output_tokens: int | None = None,
    delay: float = 0.0,
) -> FakeUpstream:
    """A fake OpenAI + Anthropic provider as an ASGI app.

    * ``report_usage=False``: no usage anywhere (no ``usage`` key; ``"usage": null`` in
      Responses objects, whose schema always has the key).
    * ``fail_status``: every request answers this status with the provider's error envelope.
    * ``stall_after=N``: a stream sends its prelude and N content chunks, then waits until the
      client disconnects or the app is cancelled. A non-streaming request never gets a response.
    * ``stop_after=N``: a stream sends its prelude and N content chunks, then raises
      :class:`UpstreamAborted` so the server drops the connection. A non-streaming response sends
      its headers and half its body first.
    * ``chunks``: words in the answer; ``output_tokens``: reported output count (default: the
      number of words), e.g. to simulate reasoning tokens.
    * ``delay``: seconds to wait before answering.

    Each option can be overridden for one request by a header: ``x-fake-fail: 500`` (``0`` for
    none), ``x-fake-usage: 0|1``, ``x-fake-stall-after: N``, ``x-fake-stop-after: N``,
    ``x-fake-chunks: N``, ``x-fake-output-tokens: N`` and ``x-fake-delay: SECONDS`` (``none``
    clears an optional one). A bad header value, a non-JSON body or a missing model gets a 400 in
    the provider's error envelope.

    ``httpx.ASGITransport`` buffers whole responses: through it a stream arrives in one piece
    and a stall yields no response at all until the caller cancels. Serve the app with uvicorn
    to see chunks arrive one by one.
    """
    return FakeUpstream(
        Options(
            report_usage=report_usage,
            fail_status=fail_status,
            stall_after=stall_after,
            stop_after=stop_after,
            chunks=chunks,
            output_tokens=output_tokens,
            delay=delay,
        )
    )


def _is_utf8_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
