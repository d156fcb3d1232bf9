"""Keeping a cache in step with the ledger, at a cost in proportion to what changed
(design.md, "Settlement").

A pass refreshes only the teams something happened to since the previous pass:

- records settled since then: by this process (handed over by its settlement step) or by any
  other (read from the settlement journal, by number); their estimates leave the cache and
  ``settled`` is raised to the ledger's aggregate;
- teams whose policies changed (their cached policy is evicted once) or that were topped up,
  by anyone (the CLI, another replica);
- teams whose keys this process filled since then: a fill may have read the ledger before a
  settlement committed and written the key after that settlement's refresh;
- teams whose refresh failed (the store was down): retried until it succeeds.

The pending estimates in the cache are not read for that. They are read, and the ledger asked
which of their records are settled, only to reconcile: on a process's first pass (estimates of
records settled before it started, by anyone, however long ago), when it may have fallen behind
the journal's pruning, when what it holds to retry grew too large, and once an hour as a
backstop.

A reconcile also finds estimates whose record will never come: a marker whose record is neither
in the ledger nor in an admission entry (a record the database refused and the recorder
dropped). Seen so twice, at least ``_ORPHAN_AFTER_US`` apart (a record being written through
as the first reconcile looked is in the ledger by the second), the estimate is removed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime

from .. import metrics
from ..clock import to_micros
from ..errors import SpendGuardError
from ..ledger import Account, Aggregate, Ledger, SettledRecord, Settlement
from ..limits import Balance, KeyCodec, Target
from ..store import RefreshEntry, Store

log = logging.getLogger("spendguard.worker")

_SECOND_US = 1_000_000
# Changes stamped with a time (policies, top-ups) are rescanned this far behind the newest one
# seen: a transaction that committed late is still caught. Acting on each is idempotent.
_OVERLAP_US = 30 * _SECOND_US
# Journal rows older than this are pruned by the settling workers.
JOURNAL_KEEP_US = 15 * 60 * _SECOND_US
# A process that has not read the journal for this long may have missed pruned rows: it
# reconciles its cache by its markers instead.
_BEHIND_US = JOURNAL_KEEP_US // 3
# A journal number missing (a transaction that took it has not committed) is looked for again
# on every pass for this long; after that its transaction rolled back.
_GAP_WAIT_US = 5 * 60 * _SECOND_US
_MAX_GAPS = 10_000
_JOURNAL_PAGE = 500  # journal rows per read (each names up to a batch of records)
_MAX_PAGES = 20  # per pass; the rest on the next pass
# The backstop: a full reconcile by markers this often.
_FULL_SYNC_US = 3600 * _SECOND_US
# Records held for a refresh that keeps failing; beyond this the cache is reconciled instead.
_MAX_PENDING = 200_000
_TEAMS_PER_READ = 500
# A marker with no record and no admission entry is removed when a reconcile this much later
# finds it so again.
_ORPHAN_AFTER_US = 60 * _SECOND_US


@dataclass(slots=True)
class SyncResult:
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


class _Watermark:
    """Changes with a time (a policy change, a top-up), read with an overlap behind the newest
    seen, so that each (team, time) is acted on once however many passes see it."""

    def __init__(self, start_us: int) -> None:
        self._mark = start_us
        self._done: dict[str, int] = {}  # team -> time of the change last acted on

    @property
    def since(self) -> int:
        return self._mark - _OVERLAP_US

    def new(self, changed: dict[str, int]) -> dict[str, int]:
        """The changes not acted on yet."""
        return {t: at for t, at in changed.items() if self._done.get(t, -1) < at}

    def done(self, team: str, at: int) -> None:
        self._done[team] = max(at, self._done.get(team, -1))

    def advance(self, changed: dict[str, int]) -> None:
        if changed:
            self._mark = max(self._mark, *changed.values())
        horizon = self._mark - 2 * _OVERLAP_US
        self._done = {t: at for t, at in self._done.items() if at >= horizon}


@dataclass(slots=True)
class _JournalCursor:
    """Where this process is in the settlement journal.

    Numbers are taken in each transaction's last statement, but on PostgreSQL two transactions
    can still commit in the other order: a number missing below the newest one read is a gap,
    looked for again on every pass until its row shows up or its wait runs out.
    """

    mark: int | None = None  # every row up to here was read (or is a gap)
    read_at: int | None = None  # when the journal was last read, µs
    gaps: dict[int, int] = field(default_factory=dict)  # number -> when first missed, µs
    own: set[int] = field(default_factory=set)  # this process's own rows after the mark
    overflow: bool = False  # more numbers went missing than can be tracked

    def restart(self, head: int, now_us: int) -> None:
        self.mark, self.read_at = head, now_us
        self.gaps.clear()
        self.overflow = False
        self.own = {s for s in self.own if s > head}

    def wanted(self, seqs: Sequence[int]) -> list[int]:
        """The rows to read: those of other processes, and the gaps."""
        return [s for s in seqs if s not in self.own] + list(self.gaps)

    def advance(self, seqs: Sequence[int], found: Collection[int], now_us: int) -> None:
        """``seqs`` were read after the mark and ``found`` (of them, or of the gaps) fetched."""
        assert self.mark is not None
        for seq in found:
            self.gaps.pop(seq, None)
        if seqs:
            if seqs[-1] - self.mark - len(seqs) > _MAX_GAPS:
                self.overflow = True  # too many numbers missing to track one by one
            else:
                seen = set(seqs)
                for seq in range(self.mark + 1, seqs[-1]):
                    if seq not in seen and seq not in self.own:
                        self.gaps.setdefault(seq, now_us)
            self.mark = seqs[-1]
            self.own = {s for s in self.own if s > self.mark}

    def expire_gaps(self, now_us: int) -> bool:
        """Forget gaps waited on long enough (rolled back); False when there were too many to
        track (then they are all forgotten: the caller reconciles instead)."""
        self.gaps = {s: at for s, at in self.gaps.items() if now_us - at <= _GAP_WAIT_US}
        tracked = not self.overflow and len(self.gaps) <= _MAX_GAPS
        if not tracked:
            self.gaps.clear()
            self.overflow = False
        return tracked


class CacheSync:
    """One process's cache sync; ``run()`` is one pass."""

    def __init__(
        self, ledger: Ledger, store: Store, codec: KeyCodec, clock: Callable[[], datetime]
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._codec = codec
        self._clock = clock
        start = to_micros(clock())
        self._policies = _Watermark(start)
        self._topups = _Watermark(start)
        self._journal = _JournalCursor()
        # Settled records whose estimates are still to leave the cache, by team.
        self._pending: dict[str, dict[str, SettledRecord]] = {}
        self._pending_count = 0
        self._dirty: set[str] = set()  # teams whose keys need the ledger's values again
        # Teams to reconcile by their markers; None: every team (a first pass, a backstop).
        self._unreconciled: set[str] | None = None
        self._reconciled_at = start
        # Markers with neither a record nor an entry: record id -> when first seen so.
        self._orphans_seen: dict[str, int] = {}
        # Those to remove on the team's next refresh: team -> usage key -> record ids.
        self._orphans: dict[str, dict[str, list[str]]] = {}

    # -- what happened in this process ----------------------------------------------------
    def settled(self, batch: Settlement) -> None:
        """Records this process settled: their estimates leave the cache on the next pass."""
        if batch.seq is not None:
            self._journal.own.add(batch.seq)
        for records in batch.records.values():
            self._hold(records)

    def filled(self, team: str) -> None:
        """This process filled keys of ``team``: the next pass raises them to the ledger's
        values, in case the fill read the ledger before a settlement its refresh missed."""
        self._dirty.add(team)

    # -- one pass -------------------------------------------------------------------------
    async def run(self) -> SyncResult:
        result = SyncResult()
        # Fills noted from here on wait for the next pass; teams of this one that are not
        # refreshed (a failure, a crash half-way) go back to wait for it too.
        dirty, self._dirty = self._dirty, set()
        try:
            await self._sync(dirty, result)
        finally:
            self._dirty |= dirty
        return result

    async def _sync(self, dirty: set[str], result: SyncResult) -> None:
        now = self._clock()
        now_us = to_micros(now)
        dirty |= await self._evict_changed_policies()
        dirty |= await self._topped_up()
        await self._follow_journal(now_us)
        if now_us - self._reconciled_at >= _FULL_SYNC_US:
            self._unreconciled = None
        if self._unreconciled is None or self._unreconciled:
            dirty |= await self._reconcile(now, now_us)
        # The records this pass drops, taken before the ledger's values are read: every one of
        # them is in those values. A record handed over while the read is in flight (a
        # settlement in this process, concurrently) waits for the next pass; dropped now, its
        # estimate would leave the cache with an aggregate that lacks its charge.
        held = {team: dict(records) for team, records in self._pending.items()}
        teams = sorted(held.keys() | dirty)
        if not teams:
            return
        # Read after the journal and the markers: every record dropped below is in these values.
        keys = await self._keys(now, teams)
        for team in teams:
            if await self._refresh_team(team, keys.get(team, []), held.get(team, {}), result):
                dirty.discard(team)

    async def _evict_changed_policies(self) -> set[str]:
        """Evict the cached policy of each team whose policies changed, once per change: the
        rescan window sees a change for many passes, and evicting on each would make every
        request of that team reload from the ledger (and race its own fill). Returns the
        teams evicted: their keys are refreshed too (a reactivated limit's aggregate)."""
        changed = await self._ledger.policies_changed_since(self._policies.since)
        evicted: set[str] = set()
        for team, at in self._policies.new(changed).items():
            try:
                await self._store.evict_policy(self._codec.policy_key(team))
            except SpendGuardError as exc:
                log.warning("spendguard could not evict the policy cache of %s: %s", team, exc)
                continue
            self._policies.done(team, at)
            evicted.add(team)
        self._policies.advance(changed)
        return evicted

    async def _topped_up(self) -> set[str]:
        """Teams topped up lately (by anyone): their balance key is raised. A top-up is seen
        on every pass of the rescan window; raising a key again is idempotent and cheap."""
        changed = await self._ledger.topped_up_since(self._topups.since)
        self._topups.advance(changed)
        return set(changed)

    async def _follow_journal(self, now_us: int) -> None:
        """Hold the records other processes settled since the last pass."""
        cursor = self._journal
        if cursor.mark is None or cursor.read_at is None or now_us - cursor.read_at > _BEHIND_US:
            # A first pass, or rows this process never read may be pruned: follow the journal
            # from where it is now, and reconcile the cache by its markers for what came before.
            cursor.restart(await self._ledger.journal_head(), now_us)
            self._unreconciled = None
            return
        for _ in range(_MAX_PAGES):
            seqs = await self._ledger.journal_after(cursor.mark, _JOURNAL_PAGE)
            wanted = cursor.wanted(seqs)
            found = await self._ledger.journal_records(wanted) if wanted else {}
            cursor.advance(seqs, found.keys(), now_us)
            for records in found.values():
                self._hold(records)
            if len(seqs) < _JOURNAL_PAGE:
                break
        cursor.read_at = now_us
        if not cursor.expire_gaps(now_us):
            self._unreconciled = None

    async def _reconcile(self, now: datetime, now_us: int) -> set[str]:
        """Read the markers of the teams to reconcile and hold those the ledger shows settled
        (by anyone, however long ago). Returns the teams read; a team whose markers could not
        be read is tried again on the next pass."""
        whole = self._unreconciled is None
        keys = await self._keys(now, None if whole else sorted(self._unreconciled or ()))
        failed: set[str] = set()
        asked: dict[str, str] = {}  # record id -> team
        where: dict[str, tuple[str, str]] = {}  # record id -> (team, usage key), no entry
        for team, team_keys in keys.items():
            try:
                markers = await self._store.pending_records([k.usage_key for k in team_keys])
                # Read after the markers: an entry leaves only once its record is written.
                entries = (
                    await self._store.open_entries(self._codec.entries_key(team)) if markers else {}
                )
            except SpendGuardError as exc:
                log.warning("spendguard could not read pending estimates of %s: %s", team, exc)
                failed.add(team)
                continue
            held = self._pending.get(team, {})
            for usage_key, ids in markers.items():
                for rid in ids:
                    if rid not in held:
                        asked[rid] = team
                        if rid not in entries:
                            where[rid] = (team, usage_key)
        found = await self._ledger.settled_records(sorted(asked)) if asked else {}
        self._unreconciled = failed
        if whole:
            self._reconciled_at = now_us
        self._hold(found.values())  # after: holding too many asks for a reconcile again
        unsettled = [rid for rid in where if rid not in found]
        recorded = await self._ledger.recorded(unsettled) if unsettled else set()
        self._note_orphans({rid: where[rid] for rid in unsettled if rid not in recorded}, now_us)
        return set(keys) - failed

    def _note_orphans(self, orphans: dict[str, tuple[str, str]], now_us: int) -> None:
        """Estimates whose record will never come: removed on their second sighting."""
        seen, self._orphans_seen = self._orphans_seen, {}
        for rid, (team, usage_key) in orphans.items():
            first = seen.get(rid, now_us)
            if now_us - first >= _ORPHAN_AFTER_US:
                self._orphans.setdefault(team, {}).setdefault(usage_key, []).append(rid)
                self._dirty.add(team)
            else:
                self._orphans_seen[rid] = first

    def _hold(self, records: Iterable[SettledRecord]) -> None:
        for rec in records:
            team = self._pending.setdefault(rec.team, {})
            if rec.id not in team:
                team[rec.id] = rec
                self._pending_count += 1
        if self._pending_count > _MAX_PENDING:
            # The store has been failing for long: stop holding records and read the cache's
            # markers once it is back instead.
            log.warning("spendguard holds too many settled records to refresh; will reconcile")
            self._pending.clear()
            self._pending_count = 0
            self._unreconciled = None

    async def _keys(self, now: datetime, teams: Sequence[str] | None) -> dict[str, list[_Key]]:
        """Per team (every team with policies or an account, or just ``teams``), the keys of
        its current windows and balance, with the ledger's values."""
        if teams is None:
            return self._team_keys(
                await self._ledger.policy_aggregates(now), await self._ledger.balance_accounts()
            )
        out: dict[str, list[_Key]] = {}
        for start in range(0, len(teams), _TEAMS_PER_READ):
            chunk = teams[start : start + _TEAMS_PER_READ]
            aggregates = await self._ledger.policy_aggregates(now, chunk)
            accounts = await self._ledger.balance_accounts(chunk)
            out.update(self._team_keys(aggregates, accounts))
        return out

    def _team_keys(
        self, aggregates: dict[str, list[Aggregate]], accounts: dict[str, Account]
    ) -> dict[str, list[_Key]]:
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

    async def _refresh_team(
        self, team: str, keys: list[_Key], held: dict[str, SettledRecord], result: SyncResult
    ) -> bool:
        """One store call for the team's keys, dropping the estimates of ``held``; False when
        it failed (retried next pass)."""
        orphans = self._orphans.get(team, {})
        if keys:
            entries = _entries(keys, held.values())
            if orphans:
                # Removed like a record whose postflight outcome is unknown: the marker goes
                # with its estimate (a tombstone where there is none).
                entries = [
                    dataclasses.replace(e, unknown=(*e.unknown, *orphans.get(e.usage_key, ())))
                    for e in entries
                ]
            try:
                await self._store.refresh(entries)
            except Exception as exc:
                # The ledger is committed; a failed refresh must not undo it (retried), and one
                # team's failure, whatever it is (the store down, or a value its script refuses),
                # must not stop the pass for the others.
                result.refresh_failures += 1
                metrics.CACHE_REFRESH_FAILURES.inc()
                log.log(
                    logging.WARNING if isinstance(exc, SpendGuardError) else logging.ERROR,
                    "spendguard cache refresh failed for team %s: %r",
                    team,
                    exc,
                )
                return False
            result.teams_refreshed += 1
        if orphans:
            gone = sum(len(ids) for ids in self._orphans.pop(team).values())
            log.warning(
                "spendguard removed %d pending estimates of team %s whose records never "
                "reached the ledger",
                gone,
                team,
            )
        # Done, or nothing cached is the team's any more (no policy, no account). Records held
        # since the values were read stay for the next pass.
        pending = self._pending.get(team, {})
        for rid in held:
            if pending.pop(rid, None) is not None:
                self._pending_count -= 1
        if not pending:
            self._pending.pop(team, None)
        return True


def _entries(keys: list[_Key], records: Iterable[SettledRecord]) -> list[RefreshEntry]:
    """The refresh of each key: the ledger's values, and the records whose estimates it drops
    (tombstones for those whose postflight outcome was unknown)."""
    # Calendar windows split at UTC midnight, so records of one key and UTC date count toward
    # the same keys: one question per group, not per record.
    groups: dict[tuple[str | None, date], list[SettledRecord]] = defaultdict(list)
    for rec in records:
        groups[(rec.api_key, rec.t0.date())].append(rec)
    entries = []
    for key in keys:
        mine = [
            rec
            for group in groups.values()
            if group[0].counts_toward(key.target, key.bucket)
            for rec in group
        ]
        entries.append(
            RefreshEntry(
                key.usage_key,
                key.settled,
                applied=tuple(r.id for r in mine if not r.unknown),
                unknown=tuple(r.id for r in mine if r.unknown),
                limit=key.limit,
            )
        )
    return entries
