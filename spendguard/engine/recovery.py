"""Recovery of the admission entries a dead gateway left (design.md, "Durable records").

A settling worker runs :meth:`Recovery.run_once` before it settles: for every owner that no
longer heartbeats, each entry it left becomes a record (see :mod:`.entries`), written
idempotently, and the entry goes once the ledger has it. The database being down leaves the
entries where they are for the next pass; a record the database refuses for what it is is
dropped loudly, like the recorder does, so it cannot block the others.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from .. import metrics
from ..alerts.service import move_alerts, sweep_bucket_alerts
from ..errors import LedgerBusy, LedgerDown, LedgerRefused, LedgerUnavailable, StoreUnavailable
from ..ledger import Ledger
from ..limits import KeyCodec
from ..record import InferenceRecord
from ..store import OwnerLog, Store
from .costing import Coster
from .entries import is_open, owner_of, recovered_record

log = logging.getLogger("spendguard.recovery")

HoldCloser = Callable[[InferenceRecord], Awaitable[None]]


class Recovery:
    def __init__(
        self,
        ledger: Ledger,
        store: Store,
        owners: OwnerLog,
        codec: KeyCodec,
        coster: Coster,
        *,
        me: str,
        holds: HoldCloser | None = None,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._owners = owners
        self._codec = codec
        self._coster = coster
        self._me = me
        # Turns a recovered admission's other holds (its budgets') into what it is charged.
        self._holds = holds

    async def run_once(self) -> int:
        """Recover the entries of every dead owner; returns the records written."""
        codec, owners = self._codec, self._owners
        written = 0
        for owner in await owners.members(codec.owners_key()):
            if owner == self._me or await owners.exists(codec.owner_alive_key(owner)):
                continue
            teams_key = codec.owner_teams_key(owner)
            for team in await owners.members(teams_key):
                written += await self._recover_team(owner, team)
                # The alerts it fired and had not moved into the outbox yet.
                await move_alerts(self._ledger, self._store, codec, team)
            # Its budgets' alerts: which buckets they wait in died with it, so every bucket's
            # (rare: once per dead gateway).
            await sweep_bucket_alerts(self._ledger, self._store)
            # Every entry it left is in the ledger now (a failure above raised): forget it.
            await owners.delete(teams_key)
            await owners.remove_member(codec.owners_key(), owner)
        return written

    async def _recover_team(self, owner: str, team: str) -> int:
        key = self._codec.entries_key(team)
        entries = await self._store.open_entries(key)
        records: list[InferenceRecord] = []
        cut: list[InferenceRecord] = []  # in flight when the gateway died
        done: list[str] = []
        for rid, value in entries.items():
            if owner_of(value) != owner:
                continue
            try:
                record = recovered_record(rid, value, 0)
            except ValueError as exc:
                log.error("spendguard dropped admission entry %s of team %s: %s", rid, team, exc)
                done.append(rid)
                continue
            if is_open(value):
                # Never finished: charged what admission allowed it to use, at this process's
                # price, which the record keeps (settlement charges it, not its own table's).
                price = self._coster.price(record.model)
                estimate = 0 if price is None else int(price.cost(record.usage))
                text = "" if price is None else price.encode()
                record = dataclasses.replace(record, estimate_micros=estimate, price=text)
                cut.append(record)
            records.append(record)
        if not records and not done:
            return 0
        written = await self._write(records)
        await self._close_holds(written)
        done += [r.id for r in records]
        await self._store.close_entries({key: done})
        await self._free_slots(cut)
        for r in written:
            metrics.RECOVERED_RECORDS.labels("open" if r.status_code == 0 else "closed").inc()
        if written:
            log.warning(
                "spendguard recovered %d records of team %s from gateway %s, which stopped "
                "without writing them",
                len(written),
                team,
                owner,
            )
        return len(written)

    async def _close_holds(self, written: list[InferenceRecord]) -> None:
        """The budgets' holds of the recovered admissions become what they are charged, as
        the gateway's own finish would have made them (before the entries go: a pass that
        dies in between is repeated, and a hold is closed once). A store that fails leaves a
        hold to its expiry."""
        if self._holds is None:
            return
        for record in written:
            try:
                await self._holds(record)
            except Exception as exc:  # a budget is not money: never block the records
                log.warning("spendguard left the budget hold of %s to expire: %r", record.id, exc)

    async def _free_slots(self, cut: list[InferenceRecord]) -> None:
        """Requests a dead gateway had in flight leave its key's and team's rates now rather
        than at their deadline (design.md, "Rates"); a TPM reservation counts what the record
        is charged, the admission estimate. A store that fails leaves it to the deadline."""
        for r in cut:
            team, api_key = r.identity.team, r.identity.api_key
            keys = {self._codec.rate_key(team, api_key), self._codec.rate_key(team, None)}
            tokens = r.usage.input_tokens + r.usage.output_tokens
            try:
                await self._store.postflight(r.id, None, [], rate_keys=sorted(keys), tokens=tokens)
            except (StoreUnavailable, ValueError) as exc:
                log.warning("spendguard left the rate slots of %s to their deadline: %s", r.id, exc)
                return

    async def _write(self, records: list[InferenceRecord]) -> list[InferenceRecord]:
        """Write idempotently; the records the database refuses while it answers are dropped
        (ERROR log, counted). LedgerUnavailable when it is down: everything stays."""
        try:
            await self._ledger.insert_records(records)
            return records
        except LedgerBusy:
            raise
        except LedgerUnavailable:
            pass
        kept: list[InferenceRecord] = []
        refused: list[InferenceRecord] = []
        for record in records:
            try:
                await self._ledger.insert_records([record])
                kept.append(record)
            except (LedgerBusy, LedgerDown):
                raise  # every entry stays for the next pass
            except LedgerRefused:
                refused.append(record)
            except LedgerUnavailable:
                refused.append(record)
                await self._ledger.ping()  # of no known kind: refused only if it answers
        if refused:
            for record in refused:
                metrics.RECORDS_DROPPED.inc()
                log.error(
                    "spendguard dropped recovered record %s of team %s: the database refuses it",
                    record.id,
                    record.identity.team,
                )
        return kept
