"""A webhook receiver on a loopback port, in a thread: it keeps every request it gets and
answers ``status`` (set it to 503 and the receiver is "down")."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .ports import HOST


@dataclass(frozen=True)
class Delivery:
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class WebhookReceiver:
    def __init__(self) -> None:
        self.status = 200
        self.got: list[Delivery] = []  # every request, taken or refused
        self.refused = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    status = receiver.status
                    if status < 300:
                        receiver.got.append(Delivery(headers, body))
                    else:
                        receiver.refused += 1
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self._server.server_port}/hook"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def taken(self) -> list[Delivery]:
        with self._lock:
            return list(self.got)
