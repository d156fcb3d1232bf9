"""Admission entries: the trace an inference leaves in a shared store before it calls the
provider, so a gateway killed while it runs loses no record (design.md, "Durable records").

The preflight script writes an *open* entry in the same call that allows the request: who
owns it (the gateway process), when it started, who pays and what its admission estimate is.
Postflight replaces it with the whole *closed* record, its price included (or removes it: an
inference that is not charged). Once the record is in the ledger the owner removes the entry.

An owner that stops heartbeating is dead; a settling worker then writes every entry it left:
a closed entry as the record it holds, an open one (a stream cut by the crash, or an inference
that never got its answer) as a record of its admission estimate, priced by the recovering
process and carrying the price it used. The ledger keeps a record id once, so the same entry
recovered twice, or recovered and also written by a recorder that got there first, is charged
once.

Values are compact JSON arrays: written on every request, read only on recovery.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _quote
from typing import Final

from ..clock import from_micros
from ..identity import Identity
from ..record import InferenceRecord, PostflightStatus
from ..usage import Usage
from ..usage.types import chars_to_tokens
from .costing import Coster, Stage
from .decision import InferenceRequest
from .pricing import PriceTable
from .reservation import DEFAULT_OUTPUT_TOKENS, DEFAULT_RESERVATION, OutputReservation

# The output an open entry is charged when the request set no output cap and nothing else was
# configured: a crashed stream's real output is unknown (the entry carries what was reserved).
RECOVERED_OUTPUT_TOKENS: Final = DEFAULT_OUTPUT_TOKENS
# The status of a record recovered from an open entry: no response status is known.
RECOVERED_STATUS: Final = 0

_OPEN, _CLOSED = 1, 2
_NO_PARTIES: tuple[None, tuple[str, ...], None] = (None, (), None)


def admission_tokens(
    request: InferenceRequest,
    table: PriceTable | None = None,
    output: OutputReservation = DEFAULT_RESERVATION,
) -> tuple[int, int]:
    """What an inference may use at most, as far as admission knows without walking the
    prompt: the whole body's size in tokens (about 4 bytes each; the JSON around the prompt
    only adds to it) and the output ``output`` reserves for it (:mod:`.reservation`, capped
    at the model's maximum where ``table`` knows it)."""
    size = request.size
    tokens_in = chars_to_tokens(size) if size else request.estimated_input_tokens
    return tokens_in, output.tokens(request, table)


def worst_case(
    request: InferenceRequest,
    coster: Coster,
    tokens: tuple[int, int] | None = None,
    output: OutputReservation = DEFAULT_RESERVATION,
) -> int:
    """What a hard limit holds for a request: its admission usage at the model's price, times
    the completions it asks for (the output of each is billed). ``tokens``: its
    :func:`admission_tokens`, when the caller has them already."""
    if tokens is None:
        tokens = admission_tokens(request, coster.table, output)
    return coster.cost(request.model, admission_usage(request, tokens), stage=Stage.HOLD)


def admission_usage(request: InferenceRequest, tokens: tuple[int, int] | None = None) -> Usage:
    tokens_in, tokens_out = admission_tokens(request) if tokens is None else tokens
    return Usage(input_tokens=tokens_in, output_tokens=tokens_out, estimated=True)


def _text(value: str | None) -> str:
    return "null" if value is None else _quote(value)


def open_entry(
    owner: str,
    identity: Identity,
    t0_us: int,
    inference_id: str,
    request: InferenceRequest,
    route: str,
    tokens: tuple[int, int] | None = None,
) -> str:
    """The entry preflight writes (JSON, built by hand: it is on every request's path);
    ``tokens``: the request's :func:`admission_tokens` (what a recovery charges)."""
    tokens_in, tokens_out = admission_tokens(request) if tokens is None else tokens
    return (
        f"[{_OPEN},{_quote(owner)},{t0_us},{_quote(identity.team_id)},"
        f"{_text(identity.api_key_id)},{_quote(inference_id)},{_quote(request.model)},"
        f"{_quote(route)},{tokens_in},{tokens_out}"
        f"{_parties(request.end_user, request.tags, request.customer)}]"
    )


def _parties(end_user: str | None, tags: tuple[str, ...], customer: str | None) -> str:
    """The end user, tags and customer at an entry's end (nothing without them: older
    entries end before them too)."""
    if end_user is None and not tags and customer is None:
        return ""
    return f",{_text(end_user)},[{','.join(_quote(t) for t in tags)}],{_text(customer)}"


def _parties_of(fields: list[object]) -> tuple[str | None, tuple[str, ...], str | None]:
    end_user, tags, customer = fields
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise TypeError("an entry's tags are a list of text")
    return _text_or_none(end_user), tuple(str(t) for t in tags), _text_or_none(customer)


def _text_or_none(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("an entry's end user and customer are text")
    return value


def closed_entry(owner: str, record: InferenceRecord, t0_us: int) -> str:
    """The entry postflight leaves: the whole record."""
    u = record.usage
    identity = record.identity
    return (
        f"[{_CLOSED},{_quote(owner)},{t0_us},{_quote(identity.team_id)},"
        f"{_text(identity.api_key_id)},{_quote(record.inference_id)},{_quote(record.model)},"
        f"{_quote(record.route)},{u.input_tokens},{u.output_tokens},{record.status_code},"
        f"{u.cached_input_tokens},{u.cache_write_tokens},{int(u.estimated)},"
        f"{record.estimate_micros},{_quote(record.postflight.value)},{_text(record.price)}"
        f"{_parties(record.end_user, record.tags, record.customer)}]"
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
    (the caller that priced it sets the price it used); a closed entry carries its own
    estimate and price (no price: written by an earlier release). Raises ValueError for a
    value that is not an entry."""
    try:
        f = json.loads(value)
        kind, _owner, t0_us, team_id, key_id, inference_id, model, route, tin, tout = f[:10]
        identity = Identity(team_id, key_id)
        t0 = from_micros(int(t0_us))
        if kind == _OPEN and len(f) in (10, 13):
            end_user, tags, customer = _parties_of(f[10:]) if len(f) == 13 else _NO_PARTIES
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
                price=None,
                end_user=end_user,
                tags=tags,
                customer=customer,
            )
        if kind == _CLOSED and len(f) in (16, 17, 20):
            status, cached, cache_write, estimated, amount, postflight = f[10:16]
            charged_at = f[16] if len(f) >= 17 else None
            end_user, tags, customer = _parties_of(f[17:]) if len(f) == 20 else _NO_PARTIES
            if charged_at is not None and not isinstance(charged_at, str):
                raise TypeError("an entry's price is text")
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
                price=charged_at,
                end_user=end_user,
                tags=tags,
                customer=customer,
            )
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"not an admission entry: {value[:200]!r}") from exc
    raise ValueError(f"not an admission entry: {value[:200]!r}")


def is_open(value: str) -> bool:
    return value.startswith(f"[{_OPEN},")
