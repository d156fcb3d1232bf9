"""Settlement (R7): exact charges into the ledger, then the cache refreshed from it.

``run_once()`` is one deterministic pass (tests, ``spendguard settle``); ``run()`` loops it
every interval, subtracting the pass's own time from the sleep.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO

import anyio
from anyio.abc import TaskStatus

from . import metrics
from .costing import Coster
from .errors import LedgerUnavailable, SpendGuardError
from .keys import balance_key, parse_field, usage_key
from .ledger import Ledger, RecordRow, SettledRecord, Settlement
from .periods import Period, period_id, to_micros, utcnow
from .store.base import RefreshEntry, Store
from .usage import Usage

log = logging.getLogger("spendguard.worker")

_MAX_BATCHES_PER_PASS = 100  # bound one pass; the next tick picks up the rest
_OVERLAP_US = 30_000_000
_PASS_TIMEOUT = 60.0


@dataclass(slots=True)
class PassResult:
    settled: int = 0
    total_micros: int = 0
    estimate_error_micros: int = 0
    teams_refreshed: int = 0
    refresh_failures: int = 0


class SettlementWorker:
    def __init__(
        self,
        ledger: Ledger,
        store: Store | None,
        coster: Coster,
        *,
        key_prefix: str,
        batch_size: int = 1000,
        settle: bool = True,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._coster = coster
        self._prefix = key_prefix
        self._batch = batch_size
        self._clock = clock
        # settle=False keeps only the cache in sync (policy changes, records settled by a
        # standalone worker): an in-process cache can only be refreshed from inside.
        self._settle = settle
        # Watermark for policy changes made by other processes (a CLI, other replicas).
        # Rescanning a window behind it catches transactions that committed late.
        self._policy_mark = to_micros(clock())
        self._evicted: dict[str, int] = {}  # team -> time of the change last evicted

    def _price(self, rec: RecordRow) -> int:
        usage = Usage(
            input_tokens=rec.input_tokens,
            output_tokens=rec.output_tokens,
            cached_input_tokens=rec.cached_input_tokens,
            cache_write_tokens=rec.cache_write_tokens,
        )
        return self._coster.cost(rec.model, usage)

    async def run_once(self) -> PassResult:
        result = PassResult()
        settled: dict[str, dict[str, SettledRecord]] = {}
        for _ in range(_MAX_BATCHES_PER_PASS if self._settle else 0):
            batch: Settlement = await self._ledger.settle(self._batch, self._price, self._clock())
            result.settled += batch.charged
            result.total_micros += batch.total_micros
            result.estimate_error_micros += batch.estimate_error_micros
            metrics.SETTLED_RECORDS.inc(batch.charged)
            error = batch.estimate_error_micros
            metrics.ESTIMATE_ERROR.labels("over" if error > 0 else "under").inc(abs(error))
            for team, recs in batch.records.items():
                settled.setdefault(team, {}).update((r.id, r) for r in recs)
            if batch.charged < self._batch:
                break
        if self._store is not None:
            await self._evict_changed_policies()
            await self._refresh(settled, result)
        return result

    async def _evict_changed_policies(self) -> None:
        """Evict the cached policy of each team whose policies changed, once per change: the
        rescan window sees a change for many passes, and evicting on each would make every
        request of that team reload from the ledger (and race its own fill)."""
        assert self._store is not None
        changed = await self._ledger.policies_changed_since(self._policy_mark - _OVERLAP_US)
        for team, at in changed.items():
            if self._evicted.get(team, -1) >= at:
                continue
            try:
                await self._store.evict_policy(team, self._prefix)
                self._evicted[team] = at
            except SpendGuardError as exc:
                log.warning("spendguard could not evict the policy cache of %s: %s", team, exc)
        if changed:
            self._policy_mark = max(self._policy_mark, *changed.values())
        horizon = self._policy_mark - 2 * _OVERLAP_US
        self._evicted = {t: at for t, at in self._evicted.items() if at >= horizon}

    async def _refresh(
        self, settled: dict[str, dict[str, SettledRecord]], result: PassResult
    ) -> None:
        """Refresh the current periods of every team with policies or a balance, new charges
        or not (R7.4): a refresh lost to a crash or a store error heals on the next pass.
        Closed periods are left to the ledger (R7.5).

        Estimates to drop are the markers of records this pass settled, plus any marker the
        cache still holds whose record the ledger shows settled: settled by another worker or
        process, or before a crash, however long ago. So no estimate outlives its record.
        """
        assert self._store is not None
        now = self._clock()
        day, month = period_id(Period.DAY, now), period_id(Period.MONTH, now)
        rows = await self._ledger.policy_aggregates(day, month)
        accounts = await self._ledger.balance_accounts()
        # Per team: (entry, api key of the scope, period, period id); None period = balance.
        plans: dict[str, list[tuple[RefreshEntry, str | None, Period | None, str]]] = {}
        for team in sorted(rows.keys() | accounts.keys()):
            entries: list[tuple[RefreshEntry, str | None, Period | None, str]] = []
            if team in accounts:
                topped_up, charged = accounts[team]
                bkey = balance_key(self._prefix, team)
                entries.append((RefreshEntry(bkey, charged, limit=topped_up), None, None, ""))
            for field, pid, value in rows.get(team, []):
                parsed = parse_field(field)
                if parsed is not None:
                    ukey = usage_key(self._prefix, team, field, pid)
                    entries.append((RefreshEntry(ukey, value), parsed[1], parsed[2], pid))
            plans[team] = entries

        # Markers of records settled elsewhere: ask the cache what each team holds, then the
        # ledger once for all teams (one query per pass, not one per team).
        known = {rid for recs in settled.values() for rid in recs}
        asked: dict[str, str] = {}  # record id -> team
        for team, entries in plans.items():
            try:
                markers = await self._store.pending_records([e[0].usage_key for e in entries])
            except SpendGuardError as exc:
                log.warning("spendguard could not read pending estimates of %s: %s", team, exc)
                continue
            for ids in markers.values():
                asked.update((rid, team) for rid in ids if rid not in known)
        if asked:
            for rid, rec in (await self._ledger.settled_records(sorted(asked))).items():
                settled.setdefault(asked[rid], {})[rid] = rec

        for team, entries in plans.items():
            recs = settled.get(team, {}).values()
            refresh = []
            for entry, key, period, pid in entries:
                mine = [
                    r
                    for r in recs
                    if period is None  # the balance: every record of the team
                    or (
                        (key is None or r.api_key == key)
                        and (r.day_id if period is Period.DAY else r.month_id) == pid
                    )
                ]
                refresh.append(
                    RefreshEntry(
                        entry.usage_key,
                        entry.settled,
                        applied=tuple(r.id for r in mine if not r.unknown),
                        unknown=tuple(r.id for r in mine if r.unknown),
                        limit=entry.limit,
                    )
                )
            try:
                await self._store.refresh(refresh)
                result.teams_refreshed += 1
            except SpendGuardError as exc:
                # The DB is committed; a failed refresh must not undo it (R7.4).
                result.refresh_failures += 1
                metrics.CACHE_REFRESH_FAILURES.inc()
                log.warning("spendguard cache refresh failed for team %s: %s", team, exc)

    def _claim_sqlite(self) -> IO[bytes] | None:
        """SQLite supports one settlement worker: take an exclusive lock file beside the
        database. A second worker says so and only keeps its own cache in sync."""
        path = self._ledger.sqlite_path
        if path is None or not self._settle:
            return None
        handle = open(f"{path}.settle.lock", "a+b")  # noqa: SIM115 - held for the loop's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            handle.close()
            log.warning(
                "another spendguard worker is settling the SQLite database %s; SQLite supports "
                "a single worker, so this one only keeps its cache in sync. Use PostgreSQL for "
                "several workers.",
                path,
            )
            self._settle = False
            return None

    async def run(
        self, interval: float, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        lock = self._claim_sqlite()
        try:
            await self._loop(interval, task_status)
        finally:
            if lock is not None:
                lock.close()

    async def _loop(self, interval: float, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
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
