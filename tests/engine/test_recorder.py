"""Tests for spendguard.engine.recorder: records survive a database outage, buffered (bounded)
and written once after recovery."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import anyio
import pytest

from spendguard.engine.recorder import Recorder
from spendguard.errors import LedgerDown, LedgerRefused, LedgerUnavailable
from spendguard.ledger import Ledger
from spendguard.record import InferenceRecord
from tests.support import make_record

pytestmark = pytest.mark.anyio


T0 = datetime(2026, 10, 1, tzinfo=UTC)


def rec(i: int) -> InferenceRecord:
    return make_record(f"r{i}", T0, i)


class FlakyLedger:
    """The real ledger behind a switch that makes every write fail like a dead database."""

    def __init__(self, real: Ledger, refuse: str | None = None) -> None:
        self.real, self.down, self.attempts, self.refuse = real, True, 0, refuse

    async def insert_records(self, batch: Any) -> None:
        self.attempts += 1
        if self.down:
            raise LedgerUnavailable("connection refused")
        if any(r.id == self.refuse for r in batch):
            raise LedgerUnavailable("invalid byte sequence")  # what PostgreSQL says to NUL
        await self.real.insert_records(batch)

    async def ping(self) -> None:
        if self.down:
            raise LedgerUnavailable("connection refused")


async def test_outage_buffers_then_writes_every_record_once(ledger: Ledger) -> None:
    flaky = FlakyLedger(ledger)
    recorder = Recorder(flaky, capacity=1000, batch_size=7, retry_max=0.05)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run)
        for i in range(1, 51):
            assert recorder.submit(rec(i))
        with anyio.fail_after(5):
            while flaky.attempts < 3:  # the writer keeps retrying while the DB is down
                await anyio.sleep(0.01)
        assert recorder.pending == 50
        flaky.down = False
        with anyio.fail_after(5):
            while recorder.pending:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert await ledger.unsettled() == (50, sum(range(1, 51)))


async def test_full_buffer_drops_loudly_and_counts(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = FlakyLedger(ledger)
    recorder = Recorder(flaky, capacity=3)  # type: ignore[arg-type]
    assert all(recorder.submit(rec(i)) for i in range(3))
    assert not recorder.submit(rec(99))
    assert recorder.dropped == 1
    assert "record buffer full" in caplog.text
    flaky.down = False
    await recorder.flush()  # what shutdown does
    assert await ledger.unsettled() == (3, 0 + 1 + 2)


async def test_flush_raises_while_the_database_is_down(ledger: Ledger) -> None:
    recorder = Recorder(FlakyLedger(ledger), capacity=10)  # type: ignore[arg-type]
    recorder.submit(rec(1))
    with pytest.raises(LedgerUnavailable):
        await recorder.flush()
    assert recorder.pending == 1  # kept for the next attempt, not lost


async def test_a_record_the_database_refuses_does_not_block_the_others(ledger: Ledger) -> None:
    flaky = FlakyLedger(ledger, refuse="r2")
    flaky.down = False
    recorder = Recorder(flaky, capacity=10)  # type: ignore[arg-type]
    for i in range(1, 5):
        recorder.submit(rec(i))
    await recorder.flush()
    assert recorder.pending == 0 and recorder.dropped == 1
    assert await ledger.unsettled() == (3, 1 + 3 + 4)


async def test_a_record_the_real_database_refuses_is_dropped_and_the_rest_written(
    ledger: Ledger,
) -> None:
    """No double: the real ledger refuses a record (an amount beyond BIGINT), and the real ping
    must tell "this record" from "the database is down"."""
    poison = make_record("poison", T0, 2**63)  # one past BIGINT's range, on both databases
    recorder = Recorder(ledger, capacity=10)
    for record in (rec(1), poison, rec(3)):
        recorder.submit(record)
    await recorder.flush()
    assert recorder.pending == 0 and recorder.dropped == 1
    assert await ledger.unsettled() == (2, 1 + 3)
    recorder.submit(rec(4))  # and the writer goes on
    await recorder.flush()
    assert await ledger.unsettled() == (3, 1 + 3 + 4)


async def test_ping_answers_on_a_live_database(ledger: Ledger) -> None:
    await ledger.ping()  # raised LedgerUnavailable on PostgreSQL (a bound literal it refused)


async def test_no_connection_slot_left_drops_nothing(ledger: Ledger) -> None:
    """Every record write fails because the server has no connection slot left, while the
    connection the ping uses still answers: that is the database being unreachable, not the
    records being refused. Nothing is dropped; everything is written once slots free up."""

    class Exhausted(FlakyLedger):
        async def insert_records(self, batch: Any) -> None:
            self.attempts += 1
            if self.down:
                raise LedgerDown("TooManyConnectionsError('sorry, too many clients already')")
            await self.real.insert_records(batch)

        async def ping(self) -> None:  # a pooled connection that still works
            return None

    full = Exhausted(ledger)
    recorder = Recorder(full, capacity=100)  # type: ignore[arg-type]
    for i in range(1, 6):
        recorder.submit(rec(i))
    with pytest.raises(LedgerDown):
        await recorder.flush()
    assert recorder.dropped == 0 and recorder.pending == 5
    full.down = False
    await recorder.flush()
    assert recorder.dropped == 0 and await ledger.unsettled() == (5, 15)


async def test_the_real_drivers_say_refused_or_down(ledger: Ledger, database_url: str) -> None:
    """The classification behind the above on the real databases: a value out of range is
    refused; a server that can't be reached is down."""
    with pytest.raises(LedgerRefused):
        await ledger.insert_records([make_record("poison", T0, 2**63)])
    if database_url.startswith("postgresql"):
        gone = Ledger("postgresql://postgres@127.0.0.1:1/none")
        with pytest.raises(LedgerDown):
            await gone.connect()
            await gone.insert_records([rec(1)])
