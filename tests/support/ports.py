"""Free loopback ports for servers a test or a benchmark starts."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The kernel hands out an unused port for port 0 and we release it at once, so another
    process may take it before our server binds it: launchers that care retry with a new one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port
