"""Tests for spendguard.ledger.records: inference records are written once, whatever they hold."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.identity import Identity
from spendguard.ledger import Ledger
from spendguard.record import InferenceRecord, PostflightStatus
from spendguard.usage import Usage
from tests.ledger.helpers import SEP30_LATE
from tests.support import make_record

pytestmark = pytest.mark.anyio


async def test_records_are_written_once(ledger: Ledger) -> None:
    rec = make_record("r1", SEP30_LATE, 10)
    await ledger.insert_records([rec])
    await ledger.insert_records([rec])  # a re-send after an unknown outcome
    assert await ledger.unsettled() == (1, 10)
    assert await ledger.unsettled("acme") == (1, 10)
    assert await ledger.unsettled("other") == (0, 0)


async def test_hostile_display_text_is_stored(ledger: Ledger) -> None:
    odd = InferenceRecord(
        id="odd",
        inference_id="odd",
        identity=Identity("team\x00nul", "key\ud800"),
        model="m\x00",
        route="/v1/chat/completions",
        t0=datetime(2026, 10, 1, tzinfo=UTC),
        status_code=200,
        usage=Usage(input_tokens=1),
        estimate_micros=1,
        postflight=PostflightStatus.APPLIED,
    )
    await ledger.insert_records([odd])
    assert await ledger.unsettled() == (1, 1)
