"""Inference records as the engine writes them, for ledger, recorder and settlement tests."""

from __future__ import annotations

from datetime import datetime

from spendguard.identity import Identity
from spendguard.ledger import RecordRow
from spendguard.record import InferenceRecord, PostflightStatus
from spendguard.usage import Usage

UNIT_PRICE = "1,1,1,1"  # one micro-USD per token of every kind, as Price.encode writes it


def make_record(
    rid: str,
    t0: datetime,
    tokens: int,
    team: str = "acme",
    key: str | None = "alpha",
    postflight: PostflightStatus = PostflightStatus.APPLIED,
    price: str | None = UNIT_PRICE,
) -> InferenceRecord:
    """A 200 chat record of ``tokens`` input tokens, estimated at one micro-USD per token
    (``price``: the price it carries; None for a record of an earlier release)."""
    return InferenceRecord(
        id=rid,
        inference_id=rid,
        identity=Identity(team, key),
        model="m",
        route="/v1/chat/completions",
        t0=t0,
        status_code=200,
        usage=Usage(input_tokens=tokens),
        estimate_micros=tokens,
        postflight=postflight,
        price=price,
    )


def unit_price(row: RecordRow) -> int:
    """Settlement's pricing at one micro-USD per input token: expectations stay obvious."""
    return row.input_tokens
