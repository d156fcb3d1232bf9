"""Parsing of the inference request body, before the provider is called.

The middleware needs four things from a request to reserve budget up front: the model (for the
price), whether the response streams, the output cap and a rough input size. Anything malformed
is rejected here with a 400, before any money could be spent, and with a message that names the
problem; :func:`parse_request` raises nothing but :class:`BadRequest`.
"""

from __future__ import annotations

import json
import math
import re
from functools import partial
from typing import Any, Final, NoReturn

from ..engine.decision import InferenceRequest

__all__ = ["BadRequest", "InferenceRequest", "parse_request"]

MAX_MODEL_LENGTH: Final = 256
MAX_OUTPUT_TOKENS: Final = 10_000_000
MAX_CHOICES: Final = 128  # OpenAI accepts 1-128
# Output-cap fields across APIs: Chat (max_tokens, max_completion_tokens), Anthropic
# (max_tokens), Responses (max_output_tokens), legacy Completions (max_tokens).
_MAX_TOKEN_FIELDS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Fields whose text is billed as input. ``tools`` is included because function definitions are
# sent to the model as prompt text and can be large.
_PROMPT_FIELDS: Final = ("messages", "input", "prompt", "system", "instructions", "tools")
# Counting walks at most this many JSON values; the rest of an absurd prompt is not counted.
# The count is only an estimate for the reservation; the provider's report settles the bill.
_MAX_COUNTED_NODES: Final = 1_000_000
# Keys holding base64 payloads (images, audio, files). Their characters are not prompt text:
# counting them would estimate ~250k tokens for a 1 MB image that the provider bills at ~1k.
_BINARY_KEYS: Final = frozenset({"data", "file_data"})


class BadRequest(Exception):
    """The request body is invalid; answer ``status`` with ``message``."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class _NonFiniteNumber(ValueError):
    pass


def _reject_constant(name: str) -> NoReturn:
    # Python's json accepts NaN/Infinity/-Infinity by default; they are not JSON.
    raise _NonFiniteNumber(name)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # e.g. 1e999 overflows to inf
        raise _NonFiniteNumber(text)
    return value


def parse_request(
    body: bytes, path_model: str | None = None, *, estimate_now: bool = False
) -> InferenceRequest:
    """Validate an inference request body and extract what budgeting needs.

    ``path_model`` is the model a route names in its path (an Azure deployment): the upstream
    runs that one whatever the body says, so it is the one priced and checked.
    ``estimate_now``: the input estimate is wanted at admission (budgets hold it on every
    request): taken from this parse instead of parsing the body again.

    Raises :class:`BadRequest` (and nothing else) when the body is unusable.
    """
    obj = _load(body)
    if not isinstance(obj, dict):
        raise BadRequest("Request body must be a JSON object.")
    return InferenceRequest(
        model=_model(obj) if path_model is None else _model({"model": path_model}),
        stream=_stream(obj),
        max_tokens=_max_tokens(obj),
        # Otherwise walked only if the provider reports no usage (or a hard limit or a TPM
        # rate holds it): one pass over the body then. It keeps the body's bytes, not its
        # parsed objects: those would stay alive for the whole upstream call, and the garbage
        # collector walks every live container in each pass.
        estimated_input_tokens=_estimate_input_tokens(obj) if estimate_now else None,
        estimate=None if estimate_now else partial(_estimate_from_body, body),
        size=len(body),
        choices=_choices(obj),
        model_pinned=path_model is not None,
    )


def _choices(obj: dict[str, Any]) -> int:
    """OpenAI's ``n``: how many completions one request asks for (each billed)."""
    n = obj.get("n")
    if n is None:
        return 1
    if type(n) is not int:
        raise BadRequest(f"'n' must be an integer, not {_json_type(n)}.")
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"'n' must be between 1 and {MAX_CHOICES}.")
    return n


def _load(body: bytes) -> Any:
    raw = bytes(body)  # no copy for bytes; accepts bytearray/memoryview too
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"Request body is not valid UTF-8 (byte {exc.start}).") from None
    if not text or text.isspace():
        raise BadRequest("Request body is empty; expected a JSON object.")
    try:
        return _DECODER.decode(text)
    except _NonFiniteNumber as exc:
        raise BadRequest(
            f"Request body contains a non-finite number ({exc}); JSON allows finite numbers only."
        ) from None
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"Request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from None
    except RecursionError:
        raise BadRequest("Request body is nested too deeply.") from None
    except ValueError as exc:
        # e.g. an integer literal beyond Python's digit limit (int_max_str_digits).
        raise BadRequest(f"Request body is not valid JSON: {exc}.") from None


# One decoder for every request (json.loads with hooks would build a new one each time).
_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_parse_float)
_CONTROL_CHARACTER: Final = re.compile(r"[\x00-\x1f\x7f]")


def _model(obj: dict[str, Any]) -> str:
    if "model" not in obj or obj["model"] is None:
        raise BadRequest("'model' is required.")
    model = obj["model"]
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.")
    if not model.strip():
        raise BadRequest("'model' must not be empty.")
    if len(model) > MAX_MODEL_LENGTH:
        raise BadRequest(
            f"'model' is too long ({len(model)} characters, at most {MAX_MODEL_LENGTH})."
        )
    # The model name ends up in store keys, ledger rows and logs: no control characters.
    if _CONTROL_CHARACTER.search(model):
        raise BadRequest("'model' must not contain control characters.")
    return model


def _stream(obj: dict[str, Any]) -> bool:
    stream = obj.get("stream")
    if stream is None:  # absent, or null as the OpenAI SDKs may send: not streaming
        return False
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, not {_json_type(stream)}.")
    return stream


def _max_tokens(obj: dict[str, Any]) -> int | None:
    caps: list[int] = []
    for name in _MAX_TOKEN_FIELDS:
        value = obj.get(name)
        if value is None:  # absent or null
            continue
        # bool is an int subclass, and 5.0 is not an integer in the APIs' schemas.
        if type(value) is not int:
            raise BadRequest(f"'{name}' must be an integer, not {_json_type(value)}.")
        if value < 0:
            raise BadRequest(f"'{name}' must not be negative.")
        if value > MAX_OUTPUT_TOKENS:
            raise BadRequest(f"'{name}' must be at most {MAX_OUTPUT_TOKENS}.")
        caps.append(value)
    # When several are sent (e.g. max_tokens and max_completion_tokens), the provider honours
    # one of them; the largest is a safe upper bound for the reservation.
    return max(caps) if caps else None


def _estimate_from_body(body: bytes) -> int:
    """The estimate of a body :func:`parse_request` accepted (so it parses again)."""
    return _estimate_input_tokens(_load(body))


def _estimate_input_tokens(obj: dict[str, Any]) -> int:
    """ceil(prompt characters / 4), at least 1.

    Counts string values (not keys) in the prompt fields, walking iteratively so depth can't
    overflow the stack. Integers inside ``prompt``/``input`` are pre-tokenised prompts
    (Completions and Embeddings accept token arrays) and count as one token each.
    """
    chars = 0
    tokens = 0
    stack: list[Any] = [obj[name] for name in _PROMPT_FIELDS if name in obj]
    budget = _MAX_COUNTED_NODES
    while stack and budget > 0:
        budget -= 1
        value = stack.pop()
        if isinstance(value, str):
            if not value.startswith("data:"):  # data: URLs carry base64 media, not text
                chars += len(value)
        elif isinstance(value, dict):
            stack.extend(item for key, item in value.items() if key not in _BINARY_KEYS)
        elif isinstance(value, list):
            stack.extend(value)
        elif type(value) is int:
            tokens += 1
    return max(1, -(-chars // 4) + tokens)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
