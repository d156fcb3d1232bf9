"""``POST /v1/embeddings``: a ``list`` of deterministic embeddings, as floats or base64."""

from __future__ import annotations

import base64
import struct
from typing import Any, Final

from ..framing import JSON, openai_headers, openai_json
from .plan import Plan, Script, json_script

_DEFAULT_DIMENSIONS: Final = 8
_MAX_DIMENSIONS: Final = 4096


def embeddings_script(plan: Plan) -> Script:
    raw_input = plan.body.get("input")
    # A list of ints is one tokenised input; any other list holds one input per element.
    if isinstance(raw_input, list) and not all(
        isinstance(x, int) and not isinstance(x, bool) for x in raw_input
    ):
        count = len(raw_input)
    else:
        count = 1
    dimensions = plan.body.get("dimensions")
    if not (isinstance(dimensions, int) and 0 < dimensions <= _MAX_DIMENSIONS):
        dimensions = _DEFAULT_DIMENSIONS
    as_base64 = plan.body.get("encoding_format") == "base64"
    data = []
    for index in range(count):
        vector = [((index * 31 + j * 7) % 200 - 100) / 1000 for j in range(dimensions)]
        embedding: object = vector
        if as_base64:
            # The SDKs ask for base64 by default: little-endian float32, as the real API sends.
            embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    body: dict[str, Any] = {"object": "list", "data": data, "model": plan.model}
    if plan.report_usage:
        tokens = plan.usage.input_tokens
        body["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_script(openai_json(body), JSON, openai_headers(plan.request_id))
