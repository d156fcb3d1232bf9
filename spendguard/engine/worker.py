"""Settlement: exact charges into the ledger, then the cache refreshed from it (design.md,
"Settlement").

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

from .. import metrics
from ..clock import to_micros, utcnow
from ..errors import LedgerUnavailable, SpendGuardError
from ..ledger import Ledger, RecordRow, SettledRecord, Settlement
from ..limits import Balance, KeyCodec, Target
from ..store import RefreshEntry, Store
from ..usage import Usage
from .costing import Coster

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


@dataclass(frozen=True, slots=True)
class _Key:
    """One cache key a pass refreshes: a limit's current window, or a team's balance."""

    target: Target
    bucket: str
    usage_key: str
    settled: int  # the ledger's aggregate (a balance: charged)
    limit: int | None = None  # a balance: topped up


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
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._coster = coster
        self._codec = codec
        self._batch = batch_size
        self._clock = clock
        # settle=False keeps only the cache in sync (policy changes, records settled by a
        # standalone worker): an in-process cache can only be refreshed from inside.
        self._settle = settle
        # Watermark for policy changes made by other processes (a CLI, other replicas).
        # Rescanning a window behind it catches transactions that committed late.
        self._policy_mark = to_micros(clock())
        self._evicted: dict[str, int] = {}  # team -> time of the change last evicted

    @property
    def settling(self) -> bool:
        """Whether this worker settles records (False: it only keeps its cache in sync)."""
        return self._settle

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
            if batch.claimed < self._batch:
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
                await self._store.evict_policy(self._codec.policy_key(team))
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
        """Refresh the current windows of every team with policies or a balance, new charges
        or not: a refresh lost to a crash or a store error heals on the next pass. Closed
        windows are left to the ledger; their keys expire.

        Estimates to drop are the markers of records this pass settled, plus any marker the
        cache still holds whose record the ledger shows settled: settled by another worker or
        process, or before a crash, however long ago. So no estimate outlives its record.
        """
        keys = await self._keys(self._clock())
        await self._add_settled_elsewhere(keys, settled)
        for team, team_keys in keys.items():
            await self._refresh_team(team, team_keys, settled.get(team, {}), result)

    async def _keys(self, now: datetime) -> dict[str, list[_Key]]:
        """Per team, the keys to refresh with the ledger's values."""
        aggregates = await self._ledger.policy_aggregates(now)
        accounts = await self._ledger.balance_accounts()
        keys: dict[str, list[_Key]] = {}
        for team in sorted(aggregates.keys() | accounts.keys()):
            team_keys: list[_Key] = []
            account = accounts.get(team)
            if account is not None:
                balance = Balance(team)
                key = self._codec.usage_key(balance, "")
                team_keys.append(_Key(balance, "", key, account.charged, account.topped_up))
            for agg in aggregates.get(team, []):
                key = self._codec.usage_key(agg.limit, agg.bucket)
                team_keys.append(_Key(agg.limit, agg.bucket, key, agg.settled))
            keys[team] = team_keys
        return keys

    async def _add_settled_elsewhere(
        self, keys: dict[str, list[_Key]], settled: dict[str, dict[str, SettledRecord]]
    ) -> None:
        """Add the records whose estimates the cache still holds but the ledger has settled:
        ask the cache what each team holds, then the ledger once for all teams."""
        assert self._store is not None
        known = {rid for recs in settled.values() for rid in recs}
        asked: dict[str, str] = {}  # record id -> team
        for team, team_keys in keys.items():
            try:
                markers = await self._store.pending_records([k.usage_key for k in team_keys])
            except SpendGuardError as exc:
                log.warning("spendguard could not read pending estimates of %s: %s", team, exc)
                continue
            for ids in markers.values():
                asked.update((rid, team) for rid in ids if rid not in known)
        if asked:
            for rid, rec in (await self._ledger.settled_records(sorted(asked))).items():
                settled.setdefault(asked[rid], {})[rid] = rec

    async def _refresh_team(
        self,
        team: str,
        keys: list[_Key],
        records: dict[str, SettledRecord],
        result: PassResult,
    ) -> None:
        assert self._store is not None
        entries = []
        for key in keys:
            mine = [r for r in records.values() if r.counts_toward(key.target, key.bucket)]
            entries.append(
                RefreshEntry(
                    key.usage_key,
                    key.settled,
                    applied=tuple(r.id for r in mine if not r.unknown),
                    unknown=tuple(r.id for r in mine if r.unknown),
                    limit=key.limit,
                )
            )
        try:
            await self._store.refresh(entries)
            result.teams_refreshed += 1
        except SpendGuardError as exc:
            # The ledger is committed; a failed refresh must not undo it (the next pass heals).
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
