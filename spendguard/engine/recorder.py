"""Inference records to the ledger, off the request path.

Requests hand records to a bounded anyio memory stream and never wait for SQL. One writer task
batches them into the ledger; while the database is down it keeps its batch and retries with
backoff, and the stream's bound caps the memory held. When the bound is hit a record is
dropped with an ERROR log and ``dropped`` counts it: the cache already counted its estimate,
so limits still hold, but its exact charge is lost. Size ``SPENDGUARD_RECORD_BUFFER`` for your
longest expected database outage.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus

from .. import metrics
from ..errors import LedgerBusy, LedgerDown, LedgerRefused, LedgerUnavailable
from ..ledger import Ledger
from ..record import InferenceRecord

log = logging.getLogger("spendguard.recorder")

_WRITE_TIMEOUT = 30.0


class Recorder:
    def __init__(
        self,
        ledger: Ledger,
        *,
        capacity: int,
        batch_size: int = 500,
        retry_max: float = 5.0,
        linger: float = 0.025,
        on_written: Callable[[list[InferenceRecord]], Awaitable[None]] | None = None,
    ) -> None:
        self._ledger = ledger
        # Told of every batch the ledger has (or refused for good): admission entries go.
        self._on_written = on_written
        self.linger = linger  # seconds to wait for a batch to form
        self._send, self._receive = anyio.create_memory_object_stream[InferenceRecord](capacity)
        self._batch: list[InferenceRecord] = []
        self._batch_size = batch_size
        self._retry_max = retry_max
        self._lock = anyio.Lock()
        self.capacity = capacity
        self.dropped = 0
        self.running = False  # run() is writing batches (for the admin status route)
        metrics.track_pending(self)  # spendguard_records_pending, read at scrape time

    @property
    def pending(self) -> int:
        """Records accepted but not yet durable."""
        return self._send.statistics().current_buffer_used + len(self._batch)

    def submit(self, record: InferenceRecord) -> bool:
        """Queue a record without waiting; False (and a loud log) when the buffer is full."""
        try:
            self._send.send_nowait(record)
            return True
        except anyio.WouldBlock:
            self.dropped += 1
            metrics.RECORDS_DROPPED.inc()
            log.error(
                "spendguard record buffer full (%d records): dropped record %s of team %s; "
                "the ledger is not keeping up or is down",
                self.capacity,
                record.id,
                record.identity.team,
            )
            return False

    def _take(self) -> None:
        while len(self._batch) < self._batch_size:
            try:
                self._batch.append(self._receive.receive_nowait())
            except anyio.WouldBlock:
                return

    async def _write(self, *, drain: bool = False) -> None:
        async with self._lock:
            self._take()
            while self._batch:
                try:
                    await self._ledger.insert_records(self._batch)
                except (LedgerBusy, LedgerDown):
                    raise  # the data is fine: the whole batch is retried later
                except LedgerUnavailable:
                    await self._drop_poison()  # raises again when the database is down
                    continue
                metrics.RECORDS_WRITTEN.inc(len(self._batch))
                await self._written()
                self._take()
                if not drain and len(self._batch) < self._batch_size:
                    # What arrived meanwhile waits for the writer's linger: written now, it
                    # would make a batch of one or two per round trip under steady traffic.
                    return

    async def _drop_poison(self) -> None:
        """A batch failed: is the database down, or does it refuse a record for what it is?

        Records are retried one by one. A record the database refuses for what it holds (a
        value out of range, text it can't store), or that fails in a way of no known kind
        while the database answers a trivial query, is dropped (ERROR log, counted) so it can't
        block every record queued behind it. No connection (the server down, its connection
        slots used up) drops nothing: the failure propagates and the batch is kept.
        """
        refused: list[InferenceRecord] = []
        for record in self._batch:
            try:
                await self._ledger.insert_records([record])
            except (LedgerBusy, LedgerDown):
                raise  # nothing wrong with the records: the whole batch is retried later
            except LedgerRefused:
                refused.append(record)
            except LedgerUnavailable:
                await self._ledger.ping()  # raises when the database doesn't answer either
                refused.append(record)
        if refused:
            for record in refused:
                self.dropped += 1
                metrics.RECORDS_DROPPED.inc()
                log.error(
                    "spendguard dropped record %s of team %s: the database refuses it",
                    record.id,
                    record.identity.team,
                )
        metrics.RECORDS_WRITTEN.inc(len(self._batch) - len(refused))
        await self._written()

    async def _written(self) -> None:
        batch, self._batch = self._batch, []
        if self._on_written is not None:
            await self._on_written(batch)

    async def flush(self) -> None:
        """Write everything queued now; raises LedgerUnavailable if the database is down."""
        await self._write(drain=True)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.running = True
        try:
            await self._run(task_status)
        finally:
            self.running = False

    async def _run(self, task_status: TaskStatus[None]) -> None:
        task_status.started()
        delay = 0.05
        while True:
            if not self._batch:
                # Sleep until a record arrives, then take it into the batch.
                self._batch.append(await self._receive.receive())
            if self.pending < self._batch_size:
                # Linger a moment so a batch forms: a transaction per record costs about a
                # hundred times a row written in a batch. Shutdown's flush writes what is
                # queued if it cancels this wait.
                await anyio.sleep(self.linger)
            try:
                # Shielded: a write cancelled half-way (at shutdown) would leak its pooled
                # connection and leave the flush waiting for it; the timeout still bounds it.
                with anyio.CancelScope(shield=True), anyio.fail_after(_WRITE_TIMEOUT):
                    await self._write()
                metrics.pending_changed()
                delay = 0.05
            except (LedgerUnavailable, TimeoutError) as exc:
                metrics.pending_changed()
                log.warning(
                    "spendguard could not write %d records, retrying in %.2fs: %s",
                    self.pending,
                    delay,
                    exc,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, self._retry_max)
