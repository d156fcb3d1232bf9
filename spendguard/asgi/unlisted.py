"""The safety net for inference routes nobody listed.

A POST (or PUT, PATCH) that matches no guarded route may still be an inference: a gateway
route spendguard's defaults don't know, a catch-all proxy forwarding any path. When its body
looks like one (a JSON object with a ``model`` and a prompt field, or messages in a
provider's shape, or a multipart/form body with a ``model`` field) it is never silent:

- ``refuse`` (the default): answered 403 before the app is called, logged once per route,
  counted. A limiter that lets unknown routes through is one a client can walk around; the
  other defaults fail closed too (a store outage, a missing identity).
- ``warn``: passed to the app; if the app serves it (a status below 400), logged once per
  route and counted.

Routes in ``SPENDGUARD_PASS_ROUTES`` (token counters by default) pass untouched, as does a
body that is no inference. Reading the body costs the request a buffer of it, only on POSTs
that are not inference routes; one beyond ``SPENDGUARD_MAX_BODY_BYTES`` passes unread,
counted as uninspected.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import metrics
from ..settings import Settings, Unlisted
from .errors import send_error
from .routes import AMBIGUOUS, MAX_ROUTE_LENGTH, RouteTable, canonical_path, dialect_of

log = logging.getLogger("spendguard")

BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
# Fields that carry what a model is asked: chat, completions, responses, embeddings,
# moderations, speech (input), images (prompt), Gemini (contents), Vertex (instances), TGI
# (inputs), rerank (query).
PROMPT_FIELDS: Final = ("messages", "prompt", "input", "contents", "instances", "inputs", "query")
_MAX_WARNED: Final = 1000
_KEYS: Final = (b'"model"', b'"messages"', b'"contents"')


def looks_like_inference(body: bytes, content_type: str | None) -> bool:
    """Whether a request body reads as a model call (see the module docstring)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind == "multipart/form-data":
        return b'name="model"' in body
    if kind == "application/x-www-form-urlencoded":
        try:
            form = parse_qs(body.decode("latin-1"))
        except ValueError:
            return False
        return "model" in form and any(name in form for name in PROMPT_FIELDS)
    start = body.lstrip()[:1]
    if start not in (b"{", b"\xef"):  # an object, maybe after a UTF-8 byte order mark
        return False
    # A key is spelled as it is or with \u escapes: without either, the parse (most of what
    # the net costs a non-inference POST) can't find one.
    if b"\\u" not in body and not any(key in body for key in _KEYS):
        return False
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False
    if not isinstance(obj, dict):
        return False
    if isinstance(obj.get("model"), str) and any(name in obj for name in PROMPT_FIELDS):
        return True
    for name in ("messages", "contents"):  # the model may be in the path (Gemini, Bedrock)
        turns = obj.get(name)
        first = turns[0] if isinstance(turns, list) and turns else None
        if isinstance(first, dict) and ("role" in first or "parts" in first):
            return True
    return False


class _Peeked:
    """A ``receive`` for the app: the messages spendguard read first, then the real ones."""

    __slots__ = ("_messages", "_receive")

    def __init__(self, messages: list[Message], receive: Receive) -> None:
        self._messages = messages
        self._receive = receive

    async def __call__(self) -> Message:
        if self._messages:
            return self._messages.pop(0)
        return await self._receive()


class UnlistedInferences:
    """The safety net of one middleware (see the module docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.mode = settings.unlisted_inference
        self.limit = settings.max_body_bytes
        self.pass_routes = RouteTable(settings.pass_routes)
        self._warned: set[str] = set()

    async def __call__(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        passing = self.pass_routes.lookup(scope)
        if passing is not None and passing is not AMBIGUOUS:
            await app(scope, receive, send)
            return
        messages, body = await self._read(receive)
        replayed = _Peeked(messages, receive)
        if body is None:  # too large to inspect, or the client left
            if messages and messages[-1]["type"] == "http.request":
                metrics.UNLISTED_BY_ACTION["uninspected"].inc()
            await app(scope, replayed, send)
            return
        if not looks_like_inference(body, _header(scope, b"content-type")):
            await app(scope, replayed, send)
            return
        path = _where(scope)
        if self.mode is Unlisted.REFUSE:
            metrics.UNLISTED_BY_ACTION["refused"].inc()
            self._warn(scope, path, "refused (403)")
            message = (
                f"{path} looks like an inference request, but it is not one of the routes "
                "spendguard guards, so it was refused before reaching the provider. The "
                "gateway's operator can guard it (SPENDGUARD_ROUTES=default,<route>) or let it "
                "pass unlimited (SPENDGUARD_PASS_ROUTES)."
            )
            await send_error(send, dialect_of(path), 403, "unguarded_inference_route", message)
            return
        served = _Served(send)
        try:
            await app(scope, replayed, served.send)
        finally:
            if 0 < served.status < 400:
                metrics.UNLISTED_BY_ACTION["passed"].inc()
                self._warn(scope, path, f"passed UNLIMITED and UNRECORDED ({served.status})")

    async def _read(self, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The request's messages up to the end of its body; the body, or None when it ran
        past the limit (the rest is still to be received) or the client left."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages, None
            size += len(message.get("body", b""))
            if size > self.limit:
                return messages, None
            if not message.get("more_body", False):
                return messages, b"".join(bytes(m.get("body", b"")) for m in messages)

    def _warn(self, scope: Scope, path: str, outcome: str) -> None:
        if path in self._warned or len(self._warned) >= _MAX_WARNED:
            return
        self._warned.add(path)
        log.warning(
            "spendguard: %s %s looks like an inference (a model and a prompt) but is not a "
            "guarded route; it was %s. Guard it with SPENDGUARD_ROUTES=default,%s, or let it "
            "pass with SPENDGUARD_PASS_ROUTES; SPENDGUARD_UNLISTED_INFERENCE=%s (logged once "
            "per route)",
            scope["method"],
            path,
            outcome,
            path,
            self.mode.value,
        )


class _Served:
    """The status the app answered an unlisted inference with."""

    __slots__ = ("_send", "status")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


def _where(scope: Scope) -> str:
    path: str = scope["path"]
    return (canonical_path(path) or path)[:MAX_ROUTE_LENGTH]


def _header(scope: Scope, name: bytes) -> str | None:
    headers: Any = scope.get("headers", ())
    for key, value in headers:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None
