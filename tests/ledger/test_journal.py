"""Tests for spendguard.ledger.journal: every settlement batch names the records it settled,
numbered in order, and old rows are pruned."""

from __future__ import annotations

from datetime import timedelta

import pytest

from spendguard.clock import to_micros
from spendguard.ledger import Ledger
from spendguard.record import PostflightStatus
from tests.ledger.helpers import OCT1
from tests.support import make_record, unit_price

pytestmark = pytest.mark.anyio


async def test_each_batch_is_journaled_with_its_records_and_pruned(ledger: Ledger) -> None:
    start = await ledger.journal_head()
    await ledger.insert_records(
        [
            make_record("a", OCT1, 7),
            make_record("b", OCT1, 8, key=None, postflight=PostflightStatus.UNKNOWN),
            make_record("c", OCT1, 9, team="other"),
        ]
    )
    first = await ledger.settle(2, unit_price, now=OCT1)
    later = OCT1 + timedelta(minutes=1)
    second = await ledger.settle(2, unit_price, now=later)
    assert first.seq is not None and second.seq is not None
    assert start < first.seq < second.seq == await ledger.journal_head()
    assert await ledger.journal_after(start, 10) == [first.seq, second.seq]
    assert await ledger.journal_after(start, 1) == [first.seq]
    rows = await ledger.journal_records([second.seq, first.seq, second.seq + 1000])
    assert set(rows) == {first.seq, second.seq}  # a number never taken has no row
    for batch in (first, second):
        assert sorted(rows[batch.seq], key=lambda r: r.id) == sorted(
            (r for records in batch.records.values() for r in records), key=lambda r: r.id
        )
    # What the journal says is what the charges say.
    named = {r.id: r for records in rows.values() for r in records}
    assert named == await ledger.settled_records(["a", "b", "c"])
    assert named["b"].unknown and named["b"].api_key is None

    await ledger.prune_journal(to_micros(later))
    assert await ledger.journal_after(start, 10) == [second.seq]
    await ledger.prune_journal(to_micros(later) + 1)
    assert await ledger.journal_after(start, 10) == []
    # Numbers are never reused, even once pruning emptied the journal: a reader past them
    # would skip the rows that took them again.
    await ledger.insert_records([make_record("d", later, 1)])
    third = await ledger.settle(2, unit_price, now=later)
    assert third.seq is not None and third.seq > second.seq
