"""The endpoint scripts, one module per wire format, and the table that picks one per route.

Each script turns a :class:`Plan` (the answer, decided) into a :class:`Script` (the response's
bytes, split where the failure modes can cut them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from ..routes import Kind
from .chat import chat_script
from .completions import completions_script
from .embeddings import embeddings_script
from .messages import messages_script
from .plan import Plan, Script
from .responses import responses_script

__all__ = ["SCRIPTS", "Plan", "Script"]

SCRIPTS: Final[Mapping[Kind, Callable[[Plan], Script]]] = {
    "chat": chat_script,
    "completions": completions_script,
    "responses": responses_script,
    "embeddings": embeddings_script,
    "messages": messages_script,
}
"""Endpoint kind → the script that renders its answer."""
