"""Settlement: exact charges into the ledger, then the cache brought in step with it
(design.md, "Settlement").

``run_once()`` is one deterministic pass (tests, ``spendguard settle``); ``run()`` loops it
every interval, subtracting the pass's own time from the sleep. The cache side of a pass is
:class:`~spendguard.engine.cachesync.CacheSync`.
"""

from __future__ import annotations

import fcntl
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO

import anyio
from anyio.abc import TaskStatus

from .. import metrics
from ..clock import to_micros, utcnow
from ..errors import LedgerUnavailable, StoreUnavailable
from ..ledger import Ledger, RecordRow, Settlement
from ..limits import KeyCodec
from ..store import Store
from ..usage import Usage
from .cachesync import JOURNAL_KEEP_US, CacheSync
from .costing import Coster, Stage
from .pricing import Price
from .recovery import Recovery

log = logging.getLogger("spendguard.worker")

_MAX_BATCHES_PER_PASS = 100  # bound one pass; the next tick picks up the rest
_PASS_TIMEOUT = 60.0
_PRUNE_EVERY_US = 60_000_000  # how often a settling worker prunes the settlement journal
_DECODED_MAX = 4096  # record prices kept read; beyond, the memo starts over
_ENCODED_PRICE = re.compile(r"[0-9.,:|]{1,512}")


@dataclass(slots=True)
class PassResult:
    settled: int = 0
    total_micros: int = 0
    estimate_error_micros: int = 0
    teams_refreshed: int = 0
    refresh_failures: int = 0
    recovered: int = 0  # records written from a dead gateway's admission entries


class SettlementWorker:
    def __init__(
        self,
        ledger: Ledger,
        store: Store | None,
        coster: Coster,
        codec: KeyCodec,
        *,
        batch_size: int = 1000,
        settle: bool = True,
        clock: Callable[[], datetime] = utcnow,
        recovery: Recovery | None = None,
    ) -> None:
        self._ledger = ledger
        self.recovery = recovery  # records of dead gateways, before each settlement
        self._coster = coster
        self._batch = batch_size
        self._clock = clock
        # settle=False keeps only the cache in sync (policy changes, records settled by a
        # standalone worker): an in-process cache can only be refreshed from inside.
        self._settle = settle
        # Standing by for a SQLite database another worker settles: the lock is tried again
        # every pass, so that a worker whose settler died takes over (and recovers its entries).
        self._standby = False
        self._lock: IO[bytes] | None = None
        self.running = False  # run() is looping (for the admin status route)
        self._sync = None if store is None else CacheSync(ledger, store, codec, clock)
        self._pruned_at: int | None = None
        self._decoded: dict[str, Price | None] = {}  # records' prices, by their text
        # One pass at a time: run_once() called (a test, an admin's settle) while the loop's
        # pass is under way waits for it rather than interleaving with its cache sync.
        self._pass = anyio.Lock()

    @property
    def settling(self) -> bool:
        """Whether this worker settles records (False: it only keeps its cache in sync)."""
        return self._settle

    def note_filled(self, team: str) -> None:
        """This process filled cache keys of ``team`` (see ``CacheSync.filled``)."""
        if self._sync is not None:
            self._sync.filled(team)

    def _price(self, rec: RecordRow) -> int:
        """A record's charge: its usage at the price it was estimated at, so a worker or CLI
        with another price table charges what the gateway estimated. A record without one
        (written before records carried it), or whose price does not read, is priced by this
        process's table."""
        usage = Usage(
            input_tokens=rec.input_tokens,
            output_tokens=rec.output_tokens,
            cached_input_tokens=rec.cached_input_tokens,
            cache_write_tokens=rec.cache_write_tokens,
        )
        text = rec.price
        if text is not None:
            if not text:
                return 0  # its model was charged nothing when it ran
            try:
                price = self._decoded[text]
            except KeyError:
                price = self._decode(rec, text)
            if price is not None:
                return int(price.cost(usage))
        return self._coster.cost(rec.model, usage, stage=Stage.SETTLEMENT)

    def _decode(self, rec: RecordRow, text: str) -> Price | None:
        """Read a record's price once per text (a batch repeats a few prices; decoding is
        dear); one that does not read is logged once and left to the table."""
        decoded = self._decoded
        if len(decoded) >= _DECODED_MAX:
            decoded.clear()
        try:
            if _ENCODED_PRICE.fullmatch(text) is None:
                # What Price.encode writes is plain decimals: an exponent or a sign can only
                # be a hand-edited row, and a huge exponent would stall the pass in decoding.
                raise ValueError("not an encoded price")
            price: Price | None = Price.decode(text)
        except (ValueError, ArithmeticError) as exc:
            price = None
            log.error(
                "spendguard cannot read the price %r of record %s (model %r): %s; records "
                "carrying it are charged at this process's price table instead",
                text[:100],
                rec.id,
                rec.model,
                exc,
            )
        decoded[text] = price
        return price

    async def run_once(self) -> PassResult:
        result = PassResult()
        # One connection for the whole pass, not one per query.
        async with self._pass, self._ledger.session():
            if self._settle:
                await self._recover(result)
                await self._settle_batches(result)
                await self._prune_journal()
            if self._sync is not None:
                synced = await self._sync.run()
                result.teams_refreshed = synced.teams_refreshed
                result.refresh_failures = synced.refresh_failures
        return result

    async def _recover(self, result: PassResult) -> None:
        """Records of gateways that died, from their admission entries, before settling."""
        if self.recovery is None:
            return
        try:
            result.recovered = await self.recovery.run_once()
        except StoreUnavailable as exc:
            log.warning("spendguard could not recover admission entries: %s", exc)

    async def _settle_batches(self, result: PassResult) -> None:
        for _ in range(_MAX_BATCHES_PER_PASS):
            batch: Settlement = await self._ledger.settle(self._batch, self._price, self._clock())
            result.settled += batch.charged
            result.total_micros += batch.total_micros
            result.estimate_error_micros += batch.estimate_error_micros
            metrics.SETTLED_RECORDS.inc(batch.charged)
            error = batch.estimate_error_micros
            metrics.ESTIMATE_ERROR.labels("over" if error > 0 else "under").inc(abs(error))
            for limit, micros in batch.overspend.items():  # committed: counted once
                metrics.OVERSPEND.labels(*limit).inc(micros)
            if self._sync is not None:
                self._sync.settled(batch)
            if batch.claimed < self._batch:
                break

    async def _prune_journal(self) -> None:
        """Drop settlement-journal rows every cache sync has had time to read."""
        now_us = to_micros(self._clock())
        if self._pruned_at is not None and now_us - self._pruned_at < _PRUNE_EVERY_US:
            return
        await self._ledger.prune_journal(now_us - JOURNAL_KEEP_US)
        self._pruned_at = now_us

    def _claim_sqlite(self) -> IO[bytes] | None:
        """SQLite supports one settlement worker: take an exclusive lock file beside the
        database. A second worker says so, only keeps its own cache in sync, and stands by:
        :meth:`_take_over` tries the lock again every pass."""
        path = self._ledger.sqlite_path
        if path is None or not (self._settle or self._standby):
            return None
        handle = open(f"{path}.settle.lock", "a+b")  # noqa: SIM115 - held for the loop's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            handle.close()
            if not self._standby:
                log.warning(
                    "another spendguard worker is settling the SQLite database %s; SQLite "
                    "supports a single worker, so this one only keeps its cache in sync, and "
                    "takes over if that one stops. Use PostgreSQL for several workers.",
                    path,
                )
            self._settle, self._standby = False, True
            return None

    def _take_over(self) -> None:
        """A standing-by worker whose settler has stopped (the OS releases a dead process's
        lock) takes the lock and settles from this pass on."""
        self._lock = self._claim_sqlite()
        if self._lock is not None:
            self._settle, self._standby = True, False
            log.warning(
                "spendguard took over settling the SQLite database %s: its worker stopped",
                self._ledger.sqlite_path,
            )

    async def run(
        self, interval: float, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._lock = self._claim_sqlite()
        self.running = True
        try:
            await self._loop(interval, task_status)
        finally:
            self.running = False
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    async def _loop(self, interval: float, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            if self._standby:
                self._take_over()
            started = anyio.current_time()
            try:
                # A pass is not cancelled half-way (its transaction and pooled connection must
                # end cleanly); stop() waits for it, bounded by the timeout.
                with anyio.CancelScope(shield=True), anyio.fail_after(_PASS_TIMEOUT):
                    done = await self.run_once()
                if done.settled:
                    log.debug("spendguard settled %d records", done.settled)
            except (LedgerUnavailable, TimeoutError) as exc:
                log.warning("spendguard settlement failed, retrying next tick: %r", exc)
            except Exception:  # a worker that dies silently leaks budgets; keep it alive
                log.exception("spendguard settlement pass crashed")
            await anyio.sleep(max(0.0, interval - (anyio.current_time() - started)))
