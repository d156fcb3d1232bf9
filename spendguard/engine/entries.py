"""Admission entries: the trace an inference leaves in a shared store before it calls the
provider, so a gateway killed while it runs loses no record (design.md, "Durable records").

The preflight script writes an *open* entry in the same call that allows the request: who
owns it (the gateway process), when it started, who pays and what its admission estimate is.
Postflight replaces it with the whole *closed* record (or removes it: an inference that is not
charged). Once the record is in the ledger the owner removes the entry.

An owner that stops heartbeating is dead; a settling worker then writes every entry it left:
a closed entry as the record it holds, an open one (a stream cut by the crash, or an inference
that never got its answer) as a record of its admission estimate. The ledger keeps a record
id once, so the same entry recovered twice, or recovered and also written by a recorder that
got there first, is charged once.

Values are compact JSON arrays: written on every request, read only on recovery.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Final

from ..clock import from_micros, to_micros
from ..identity import Identity
from ..record import InferenceRecord, PostflightStatus
from ..usage import Usage
from .decision import InferenceRequest

# The output an open entry is charged when the request set no output cap: a crashed stream's
# real output is unknown, and this is about one long answer.
RECOVERED_OUTPUT_TOKENS: Final = 4096
# The status of a record recovered from an open entry: no response status is known.
RECOVERED_STATUS: Final = 0

_OPEN, _CLOSED = 1, 2
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode


def admission_usage(request: InferenceRequest) -> Usage:
    """What an inference may use at most, as far as admission knows: its prompt estimate and
    its output cap (or :data:`RECOVERED_OUTPUT_TOKENS`)."""
    output = request.max_tokens if request.max_tokens is not None else RECOVERED_OUTPUT_TOKENS
    return Usage(input_tokens=request.estimated_input_tokens, output_tokens=output, estimated=True)


def open_entry(
    owner: str,
    identity: Identity,
    t0: datetime,
    inference_id: str,
    request: InferenceRequest,
    route: str,
) -> str:
    usage = admission_usage(request)
    return _dumps(
        [
            _OPEN,
            owner,
            to_micros(t0),
            identity.team_id,
            identity.api_key_id,
            inference_id,
            request.model,
            route,
            usage.input_tokens,
            usage.output_tokens,
        ]
    )


def closed_entry(owner: str, record: InferenceRecord) -> str:
    u = record.usage
    identity = record.identity
    return _dumps(
        [
            _CLOSED,
            owner,
            to_micros(record.t0),
            identity.team_id,
            identity.api_key_id,
            record.inference_id,
            record.model,
            record.route,
            u.input_tokens,
            u.output_tokens,
            record.status_code,
            u.cached_input_tokens,
            u.cache_write_tokens,
            u.estimated,
            record.estimate_micros,
            record.postflight.value,
        ]
    )


def owner_of(value: str) -> str | None:
    """The gateway that wrote an entry; None for a value that is not an entry."""
    try:
        fields = json.loads(value)
    except ValueError:
        return None
    if isinstance(fields, list) and len(fields) > 1 and isinstance(fields[1], str):
        return fields[1]
    return None


def recovered_record(record_id: str, value: str, estimate: int) -> InferenceRecord:
    """The record an entry stands for. ``estimate`` prices an open entry's admission usage
    (a closed entry carries its own). Raises ValueError for a value that is not an entry."""
    try:
        f = json.loads(value)
        kind, _owner, t0_us, team_id, key_id, inference_id, model, route, tin, tout = f[:10]
        identity = Identity(team_id, key_id)
        t0 = from_micros(int(t0_us))
        if kind == _OPEN and len(f) == 10:
            usage = Usage(input_tokens=int(tin), output_tokens=int(tout), estimated=True)
            return InferenceRecord(
                id=record_id,
                inference_id=str(inference_id),
                identity=identity,
                model=str(model),
                route=str(route),
                t0=t0,
                status_code=RECOVERED_STATUS,
                usage=usage,
                estimate_micros=estimate,
                postflight=PostflightStatus.SKIPPED,  # nothing of it reached the cache
            )
        if kind == _CLOSED and len(f) == 16:
            status, cached, cache_write, estimated, amount, postflight = f[10:]
            usage = Usage(
                input_tokens=int(tin),
                output_tokens=int(tout),
                cached_input_tokens=int(cached),
                cache_write_tokens=int(cache_write),
                estimated=bool(estimated),
            )
            return InferenceRecord(
                id=record_id,
                inference_id=str(inference_id),
                identity=identity,
                model=str(model),
                route=str(route),
                t0=t0,
                status_code=int(status),
                usage=usage,
                estimate_micros=int(amount),
                postflight=PostflightStatus(postflight),
            )
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"not an admission entry: {value[:200]!r}") from exc
    raise ValueError(f"not an admission entry: {value[:200]!r}")


def is_open(value: str) -> bool:
    return value.startswith(f"[{_OPEN},")
