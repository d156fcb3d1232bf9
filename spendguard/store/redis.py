"""The Redis store: every decision is one Lua script, one round trip (design.md, "Cache keys"
and "The Redis store").

Scripts live in ``lua/*.lua`` and are reloaded after NOSCRIPT (a restart or SCRIPT FLUSH).
The hot calls (preflight, postflight, fill) go through :class:`ScriptPipeline`, which sends
the calls of concurrent requests as one pipeline; settlement's and the CLI's calls go one by
one. Keys reach scripts only through KEYS, and every key of one call shares the team's
``{team}`` hash tag, so the same code runs on Redis Cluster.

URLs: ``redis://``, ``rediss://``, ``unix://`` for one server; ``redis+cluster://host:port``
(or ``rediss+cluster://``) for a cluster, any node as the seed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache, partial
from importlib import resources
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from ..clock import to_millis, utcnow
from ..errors import ConfigurationError, StoreUnavailable
from ..identity import encode_id
from ..limits import KeyPlan
from ..limits.capacity import Acquired, Attempt, ProviderKey, Refusal, StoredKey
from ..limits.model import Unit
from ..limits.rates import WINDOW_MS as RATE_WINDOW_MS
from ..limits.windows import Rolling
from .base import (
    AlertMarks,
    CachedParts,
    EntryWrite,
    Found,
    Outcome,
    Preflight,
    RefreshEntry,
    UsageFill,
    decide,
    with_rates,
)
from .pipeline import ScriptPipeline, bounded_call, store_error
from .rolling import (
    BUCKET_TAGS,
    SHARED_SLOT,
    Bucket,
    BucketCheck,
    BucketUsage,
    Commit,
    Hold,
    Reserved,
    SeedSlice,
    WindowUsage,
    bucket_marks,
)

log = logging.getLogger("spendguard.store")

T = TypeVar("T")
_SCRIPTS = (
    "preflight",
    "fill",
    "postflight",
    "refresh",
    "pool_register",
    "pool_acquire",
    "pool_settle",
    "pool_cooldown",
    "bucket_reserve",
    "bucket_commit",
    "bucket_release",
    "bucket_stock",
    "bucket_inspect",
    "bucket_seed",
)
# bucket_reserve.lua's unit codes
_BUCKET_UNITS = {1: Unit.TOKENS, 2: Unit.USD, 3: Unit.REQUESTS}
_BUCKET_KINDS = {tag: kind for kind, tag in BUCKET_TAGS.items()}
_MAX_BUCKET_WIRES = 10_000
_BUCKET_ENDS = (":holds", ":alerts")


def _bucket_of(key: str, start: int) -> Bucket | None:
    """The bucket a budget key belongs to (``start``: where its hash tag's text begins), or
    None for any other key. A bucket in a slot of its own names itself in the tag
    (``{bt:x}:budget:holds``); one in its team's or the shared slot after ``budget:``."""
    slot, _, rest = key[start:].partition("}:budget:")
    if rest.startswith(("holds", "alerts", "w:")):
        name = slot
    elif rest.endswith(_BUCKET_ENDS):
        name = rest.rpartition(":")[0]
    else:
        name = rest.rpartition(":w:")[0]
    kind, _, subject = name.partition(":")
    found = _BUCKET_KINDS.get(kind)
    return None if found is None else Bucket(found, subject)


# pool_acquire.lua's answer codes.
_REFUSALS = {0: Refusal.UNKNOWN, 2: Refusal.COOLING, 3: Refusal.FULL, 4: Refusal.TOO_LARGE}
# Hash fields per HSCAN step when reading markers: a call of about a millisecond in Redis.
MARKER_PAGE = 1000
# Record ids (over all its keys) per refresh call: a few milliseconds of Redis each.
REFRESH_IDS = 1000
# Plans whose preflight keys and arguments are kept (one per identity and window in use).
_MAX_PLANS = 16_384
# Eviction policies that never drop a key carrying a TTL behind our back.
_SAFE_EVICTION = {"noeviction"}


def _lua(name: str) -> str:
    folder = resources.files("spendguard.store") / "lua"
    text = (folder / f"{name}.lua").read_text("utf-8")
    if name.startswith("bucket_"):  # the rolling-window scripts share their helpers
        text = (folder / "bucket_common.lua").read_text("utf-8") + "\n" + text
    return text


def _ms(t: datetime) -> str:
    return str(int(t.timestamp() * 1000))


class RedisStore:
    shared = True  # every replica (and a CLI) sees the same keys

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str = "quota",
        timeout: float = 0.5,
        max_batch: int = 256,
        max_in_flight: int = 4,
    ) -> None:
        self._client = client
        # The prefix of the keys this store names itself (provider keys, budget windows); the
        # spend limits' keys come named in their plans.
        self._prefix = prefix
        self._timeout = timeout
        self._scripts = {name: client.register_script(_lua(name)) for name in _SCRIPTS}
        # Plans' keys and arguments, by the plan's id (see _plan_wire).
        self._wire: dict[int, tuple[KeyPlan, list[str], list[str], list[str]]] = {}
        # Per bucket check (by id, the check held so its id is not reused): its wire parts.
        self._bucket_wires: dict[
            int, tuple[BucketCheck, list[str], list[str], list[str], _Marks]
        ] = {}
        # The hot path: concurrent calls share pipelines; ``timeout`` bounds each batch.
        self.pipeline = ScriptPipeline(
            client, timeout=timeout, max_batch=max_batch, max_in_flight=max_in_flight
        )

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        return self._client

    @property
    def timeout(self) -> float:
        return self._timeout

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "quota",
        timeout: float = 0.5,
        max_connections: int = 512,
        max_batch: int = 256,
        max_in_flight: int = 4,
    ) -> RedisStore:
        """A store for ``url``. The timeout bounds one round trip, connecting included: a
        batch of hot-path calls (a call then ends within about twice it, queueing included),
        or any other call on its own."""
        client = client_for(url, timeout, max_connections=max_connections)
        return cls(
            client,
            prefix=prefix,
            timeout=timeout,
            max_batch=max_batch,
            max_in_flight=max_in_flight,
        )

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """One call on its own (off the hot path), bounded by the timeout from its start."""
        return await bounded_call(fn, self._timeout)

    async def _script(self, name: str, keys: Sequence[str], args: Sequence[str]) -> Any:
        script = self._scripts[name]
        return await self._call(lambda: script(keys=list(keys), args=list(args)))

    def _batched(self, name: str, keys: Sequence[str], args: Sequence[str]) -> Awaitable[Any]:
        """A hot-path script call, sent in the next pipeline (no timeout scope of its own:
        the batch's deadline bounds it)."""
        return self.pipeline.submit(self._scripts[name], keys, args)

    # -- Store ----------------------------------------------------------------------------
    async def preflight(
        self,
        plan: KeyPlan,
        entry: EntryWrite | None = None,
        *,
        record_id: str = "",
        hold: int = 0,
        model: str = "",
        tokens: int = 0,
        now_ms: int | None = None,
        slot_ttl_ms: int = 600_000,
    ) -> Preflight:
        checks = plan.checks
        wire = self._wire.get(id(plan))
        if wire is None or wire[0] is not plan:
            wire = self._plan_wire(plan)
        keys = [*wire[1]]
        rid = entry.record_id if entry is not None else record_id
        if now_ms is None:
            now_ms = to_millis(utcnow())
        args = [*wire[2], rid, _uint(hold), model, *wire[3]]
        args += (str(now_ms), _uint(tokens), str(slot_ttl_ms))
        if entry is not None:
            keys.append(entry.key)
            args.append(entry.value)
        raw = await self._batched("preflight", keys, args)
        if raw == 0:
            return Preflight(Outcome.MISS, missing_policy=True)
        if raw == "model":
            return Preflight(Outcome.MODEL)
        found: list[Found] = []
        for i, check in enumerate(checks):
            limit, settled, pending, hard, alert_at = raw[5 * i : 5 * i + 5]
            used = None if settled is None else int(settled) + int(pending or 0)
            mode = 0 if hard is None else int(hard)  # preflight.lua: "1" hard, "2" it fits
            found.append((check, None if limit is None else int(limit), used, mode, alert_at))
        pf = decide(found, hold)
        n = 5 * len(checks)
        if len(raw) == n:
            return pf  # no rates apply (or a limit decided first)
        return with_rates(pf, raw[n], raw[n + 1 : n + 3], now_ms, tokens)

    def _plan_wire(self, plan: KeyPlan) -> tuple[KeyPlan, list[str], list[str], list[str]]:
        """A plan's part of its preflight call, built once per plan (a plan is made once per
        identity and window, then reused): its keys, and its arguments before and after the
        request's own."""
        checks = plan.checks
        wire = (
            plan,  # held: the id it is found by cannot be reused while it is here
            [plan.policy_key, *(c.usage_key for c in checks), *plan.rate_keys],
            [str(len(checks)), *(c.field for c in checks)],
            [*plan.allow_fields, *plan.rate_fields],
        )
        if len(self._wire) >= _MAX_PLANS:
            self._wire.clear()
        self._wire[id(plan)] = wire
        return wire

    async def fill(
        self,
        plan: KeyPlan,
        policies: Mapping[str, int | str] | None,
        usage: Sequence[UsageFill],
        *,
        policy_ttl: float,
    ) -> None:
        args: list[str] = []
        if policies is None:
            args += ["-", "0"]
        else:
            args += [str(max(1, int(policy_ttl * 1000))), str(len(policies))]
            for field, value in policies.items():
                args += [field, value if isinstance(value, str) else _uint(value)]
        for u in usage:
            limit = "-" if u.limit is None else _uint(u.limit)
            args += [_uint(u.settled), limit, _ms(u.expires_at)]
        await self._batched("fill", [plan.policy_key, *(u.usage_key for u in usage)], args)

    async def postflight(
        self,
        record_id: str,
        amount: int | None,
        usage_keys: Sequence[str],
        *,
        entry_key: str | None = None,
        closed: str = "",
        rate_keys: Sequence[str] = (),
        tokens: int | None = None,
        withdrawn: int | None = None,
        alerts: AlertMarks | None = None,
    ) -> int:
        charge = "-" if amount is None else _uint(amount)
        used = "-" if tokens is None else _uint(tokens)
        minute = "-" if withdrawn is None else _uint(withdrawn)
        args = [record_id, charge, str(len(rate_keys)), used, minute]
        keys = [*usage_keys, *rate_keys]
        if alerts is not None and usage_keys:
            args.append("-" if entry_key is None else closed)
            args += [_marks(m) for m in alerts.marks]
            keys.append(alerts.key)
            if entry_key is not None:
                keys.append(entry_key)
            applied, fired = await self._batched("postflight", keys, args)
            alerts.fired = int(fired)
            return int(applied)
        if entry_key is None:
            if not keys:
                return 0
        else:
            args.append(closed)
            keys.append(entry_key)
        return int(await self._batched("postflight", keys, args))

    async def pending_alerts(self, alerts_key: str) -> dict[str, str]:
        found = await self._call(lambda: self._client.hgetall(alerts_key))
        return {str(k): str(v) for k, v in found.items()}

    async def drop_alerts(self, alerts_key: str, fields: Sequence[str]) -> None:
        if fields:
            await self._call(lambda: self._client.hdel(alerts_key, *fields))

    async def open_entries(self, entries_key: str) -> dict[str, str]:
        entries = await self._call(lambda: self._client.hgetall(entries_key))
        return {str(k): str(v) for k, v in entries.items()}

    async def close_entries(self, by_key: Mapping[str, Sequence[str]]) -> None:
        for key, ids in by_key.items():  # one call per team keeps it cluster-safe
            if ids:
                await self._call(lambda key=key, ids=ids: self._client.hdel(key, *ids))  # type: ignore[misc]

    # -- OwnerLog -------------------------------------------------------------------------
    async def heartbeat(self, owners_key: str, alive_key: str, owner: str, ttl_ms: int) -> None:
        await self._call(lambda: self._client.set(alive_key, "1", px=ttl_ms))
        await self._call(lambda: self._client.sadd(owners_key, owner))

    async def add_member(self, key: str, member: str) -> None:
        await self._call(lambda: self._client.sadd(key, member))

    async def members(self, key: str) -> list[str]:
        found = await self._call(lambda: self._client.smembers(key))
        return sorted(str(m) for m in found)

    async def exists(self, key: str) -> bool:
        return bool(await self._call(lambda: self._client.exists(key)))

    async def remove_member(self, key: str, member: str) -> None:
        await self._call(lambda: self._client.srem(key, member))

    async def delete(self, *keys: str) -> None:
        for key in keys:  # one call per key: they live in different slots
            await self._call(lambda key=key: self._client.delete(key))  # type: ignore[misc]

    async def refresh(self, entries: Sequence[RefreshEntry]) -> None:
        # In calls of at most REFRESH_IDS record ids: after a settlement backlog one team's
        # refresh can name tens of thousands, and one script removing them all would hold
        # Redis (every gateway's hot path) for hundreds of milliseconds. Each call is a whole
        # refresh of its records and raises every named key's settled part, which the first
        # call does for all keys: between calls the cache counts the records of the later
        # calls twice (settled and still pending), never not at all. A rerun is harmless.
        first = True
        left = [(e, list(e.applied), list(e.unknown)) for e in entries]
        while left:
            budget = REFRESH_IDS
            keys: list[str] = []
            args: list[str] = []
            for e, applied, unknown in left:
                a = applied[:budget]
                u = unknown[: budget - len(a)]
                if not (first or a or u):
                    continue
                del applied[: len(a)], unknown[: len(u)]
                budget -= len(a) + len(u)
                keys.append(e.usage_key)
                limit = "-" if e.limit is None else _uint(e.limit)
                args += [_uint(e.settled), limit, str(len(a)), str(len(u)), *a, *u]
            await self._script("refresh", keys, args)
            first = False
            left = [item for item in left if item[1] or item[2]]

    async def pending_records(self, usage_keys: Sequence[str]) -> dict[str, list[str]]:
        # Paged with HSCAN, one short call per page: after a long ledger outage a key can hold
        # hundreds of thousands of markers, and reading them in one call (a script, HKEYS)
        # would hold Redis for every gateway's hot path for as long, and outlast the timeout
        # on every retry. A marker added or removed while the pages are read may be missed
        # or seen: either is what a read a moment earlier or later would have returned.
        out: dict[str, list[str]] = {}
        for key in usage_keys:
            ids: dict[str, None] = {}  # HSCAN may return a field twice (a rehash)
            cursor = 0
            while True:
                cursor, fields = await self._call(
                    partial(self._client.hscan, key, cursor, match="r:*", count=MARKER_PAGE)
                )
                for name in fields:
                    ids[str(name)[2:]] = None  # str already: the client decodes replies
                if not int(cursor):
                    break
            if ids:
                out[key] = list(ids)
        return out

    async def evict_policy(self, policy_key: str) -> None:
        await self._call(lambda: self._client.delete(policy_key))

    async def read_parts(self, usage_keys: Sequence[str]) -> dict[str, CachedParts | None]:
        out: dict[str, CachedParts | None] = {}
        for key in usage_keys:  # a CLI/test helper: one call per key keeps it cluster-safe
            fields = await self._call(
                lambda key=key: self._client.hgetall(key)  # type: ignore[misc]
            )
            if "s" not in fields:
                out[key] = None
                continue
            held = sum(int(v) for f, v in fields.items() if str(f).startswith("h:"))
            pending = int(fields.get("p") or 0)
            out[key] = CachedParts(int(fields["s"]), pending - held, held)
        return out

    async def read_usage(self, usage_keys: Sequence[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for key in usage_keys:  # a CLI/test helper: one call per key keeps it cluster-safe
            settled, pending = await self._call(
                lambda key=key: self._client.hmget(key, ["s", "p"])  # type: ignore[misc]
            )
            out[key] = None if settled is None else int(settled) + int(pending or 0)
        return out

    async def start(self) -> None:
        await self.check_eviction_policy()
        await self.load_scripts()

    async def load_scripts(self) -> None:
        """Load every script now (on a cluster, into every primary), so that the first
        requests do not each find NOSCRIPT and pay a reload. Redis being down is no error
        here: whenever a script is missing, the pipeline loads it and resends the call."""
        for script in self._scripts.values():
            try:
                await self._call(partial(self._client.script_load, script.script))
            except StoreUnavailable as exc:
                log.warning("spendguard could not load its Redis scripts at start: %s", exc)
                return

    async def check_eviction_policy(self) -> str | None:
        """Warn when Redis may evict quota keys under memory pressure (a silent budget leak)."""
        try:
            config = await self._call(lambda: self._client.config_get("maxmemory-policy"))
        except (StoreUnavailable, ValueError):
            return None  # CONFIG is disabled on many managed services; nothing to check
        # One server answers {"maxmemory-policy": v}; a cluster may answer per node.
        answers = config.values() if "maxmemory-policy" not in config else [config]
        unsafe = [
            a["maxmemory-policy"]
            for a in answers
            if isinstance(a, dict) and a.get("maxmemory-policy") not in (None, *_SAFE_EVICTION)
        ]
        policy = unsafe[0] if unsafe else None
        if policy is not None:
            log.warning(
                "Redis maxmemory-policy is %r: under memory pressure Redis may evict spend "
                "keys and limits would reset until reloaded. Use 'noeviction' (or a dedicated "
                "instance) for spendguard.",
                policy,
            )
        return policy

    # -- rolling windows --------------------------------------------------------------------
    # A bucket's keys share one hash tag (Bucket.slot), so each script runs in one slot:
    #   {prefix}:{<team>}:budget:bk:<team>:<key>:holds     the key's holds and totals (hash),
    #                                                       in its team's slot
    #   {prefix}:{<team>}:budget:bk:<team>:<key>:w:<id>:<s>  window <id> of <s> seconds
    #   {prefix}:{<team>}:budget:bu:<team>:<end user>:...   an end user's, in its team's slot
    #   {prefix}:{pool}:budget:bm:<model>:..., …:{pool}:budget:bg:...
    #                                            a model's and the fleet's, in the shared slot
    #   {prefix}:{bt:<tag>}:budget:..., {prefix}:{bc:<customer>}:budget:...  slots of their own
    # Keys live as long as the longest window plus the hold time, refreshed on every write.
    def _bucket_base(self, bucket: Bucket) -> str:
        slot, name = bucket.slot, bucket.tag
        if slot == name:
            return f"{self._prefix}:{{{slot}}}:budget"
        return f"{self._prefix}:{{{slot}}}:budget:{name}"

    def bucket_keys(self, bucket: Bucket, windows: Sequence[Rolling]) -> list[str]:
        """The bucket's keys: holds, then one per window (one hash tag, one slot)."""
        base = self._bucket_base(bucket)
        return [f"{base}:holds", *(f"{base}:w:{w.id}:{w.label}" for w in windows)]

    def bucket_alerts_key(self, bucket: Bucket) -> str:
        return f"{self._bucket_base(bucket)}:alerts"

    def _bucket_wire(self, call: BucketCheck) -> tuple[list[str], list[str], list[str], _Marks]:
        """A bucket check's keys, its reserve's window arguments, its commit's and its
        windows' alert thresholds, made once per check (a gate reuses a plan's checks) and
        kept, bounded, with the check."""
        found = self._bucket_wires.get(id(call))
        if found is not None and found[0] is call:
            return found[1], found[2], found[3], found[4]
        limits: list[str] = []
        for check in call.checks:
            lim = check.limit
            limits += [
                str(check.window.slice_ms),
                "",  # a calendar window's oldest slice and reset: per call (_bounded)
                "",
                _opt(lim.tokens),
                _opt(lim.cost_micros),
                _opt(lim.requests),
            ]
        keys = self.bucket_keys(call.bucket, call.windows)
        slices = [x for w in call.windows for x in (str(w.slice_ms), "")]
        marks = bucket_marks(call)
        if len(self._bucket_wires) >= _MAX_BUCKET_WIRES:
            self._bucket_wires.clear()
        self._bucket_wires[id(call)] = (call, keys, limits, slices, marks)
        return keys, limits, slices, marks

    def reserve_buckets(
        self, calls: Sequence[BucketCheck], hold: Hold, *, require_seed: bool = False
    ) -> Awaitable[list[Reserved]]:
        head = [
            str(hold.now_ms),
            hold.id,
            str(hold.expires_ms),
            str(hold.tokens),
            str(hold.cost),
            "1" if hold.count_cost else "0",
            str(hold.ttl_ms),
            "1" if require_seed else "0",
        ]
        pending = []
        for call in calls:
            keys, limits, _, _ = self._bucket_wire(call)
            if call.calendar:
                limits = _bounded(call.windows, limits, hold.now_ms, 6, True)
            pending.append(self._batched("bucket_reserve", keys, head + limits))
        return self._reserved(calls, hold, pending)

    async def _reserved(
        self, calls: Sequence[BucketCheck], hold: Hold, pending: Sequence[Awaitable[Any]]
    ) -> list[Reserved]:
        replies: list[Any] = []
        for waiting in pending:
            try:
                replies.append(await waiting)
            except Exception as exc:
                replies.append(exc)
        failed = next((r for r in replies if isinstance(r, Exception)), None)
        if failed is not None:
            # Buckets that reserved before another call failed give their holds back (best
            # effort; they would expire anyway), so a fail-open retry doesn't count twice.
            taken = [c.bucket for c, r in zip(calls, replies, strict=True) if _took(r)]
            if taken:
                with contextlib.suppress(Exception):
                    await self.release_buckets(taken, hold.id)
            raise failed
        out = []
        for raw in replies:
            if int(raw[0]) == -1:
                out.append(Reserved(False, unseeded=True))
            elif int(raw[0]) == 1:
                out.append(Reserved(True, tuple(int(x) for x in raw[1:])))
            else:
                unit = _BUCKET_UNITS[int(raw[2])]
                left_t, left_c = int(raw[4]), int(raw[5])
                out.append(
                    Reserved(
                        False,
                        window=int(raw[1]) - 1,
                        unit=unit,
                        retry_ms=int(raw[3]),
                        left_tokens=None if left_t < 0 else left_t,
                        left_cost=None if left_c < 0 else left_c,
                    )
                )
        return out

    def commit_buckets(
        self,
        calls: Sequence[BucketCheck],
        hold_id: str,
        *,
        now_ms: int,
        at_ms: int,
        tokens: int,
        cost: int,
        ttl_ms: int,
        held_only: bool = False,
    ) -> Awaitable[list[Any]]:
        held = f"!{hold_id}" if held_only else hold_id  # bucket_commit.lua: only if held
        head = [str(now_ms), str(ttl_ms), "1", held, str(at_ms), str(tokens), str(cost)]
        return _fired([self._commit(call, head, now_ms) for call in calls])

    def commit_holds(
        self, call: BucketCheck, commits: Sequence[Commit], *, now_ms: int, ttl_ms: int
    ) -> Awaitable[int]:
        head = [str(now_ms), str(ttl_ms), str(len(commits))]
        for c in commits:
            head += [c.hold_id, str(c.at_ms), str(c.tokens), str(c.cost)]
        return _fired_one(self._commit(call, head, now_ms))

    def _commit(self, call: BucketCheck, head: list[str], now_ms: int) -> Awaitable[Any]:
        """``bucket_commit`` of the holds in ``head`` (its arguments up to the windows'), sent."""
        keys, _, slices, marks = self._bucket_wire(call)
        if call.calendar:
            slices = _bounded(call.windows, slices, now_ms, 2, False)
        if marks is None:
            return self._batched("bucket_commit", keys, head + slices)
        specs = [
            "" if m is None else f"{w.id} {w.epoch(now_ms)} {m}"
            for w, m in zip(call.windows, marks, strict=True)
        ]
        keys = [*keys, self.bucket_alerts_key(call.bucket)]
        return self._batched("bucket_commit", keys, [*head, *slices, "alerts", *specs])

    def release_buckets(self, buckets: Sequence[Bucket], hold_id: str) -> Awaitable[list[Any]]:
        return _gather(
            [self._batched("bucket_release", self.bucket_keys(b, ()), [hold_id]) for b in buckets]
        )

    def stock_bucket(
        self,
        call: BucketCheck,
        hold: Hold,
        ids: Sequence[str],
        share: int,
        *,
        require_seed: bool = False,
    ) -> Awaitable[int]:
        keys, limits, _, _ = self._bucket_wire(call)
        if call.calendar:
            limits = _bounded(call.windows, limits, hold.now_ms, 6, True)
        head = [
            str(hold.now_ms),
            str(hold.expires_ms),
            str(hold.tokens),
            str(hold.cost),
            "1" if hold.count_cost else "0",
            str(hold.ttl_ms),
            "1" if require_seed else "0",
            str(share),
        ]
        return _as_int(self._batched("bucket_stock", keys, [*head, *limits, *ids]))

    def release_stock(self, bucket: Bucket, ids: Sequence[str]) -> Awaitable[int]:
        return _as_int(self._batched("bucket_release", self.bucket_keys(bucket, ()), list(ids)))

    async def seed_bucket(
        self, call: BucketCheck, slices: Sequence[Sequence[SeedSlice]], ttl_ms: int
    ) -> bool:
        args = [str(ttl_ms)]
        for rows in slices:
            args.append(str(len(rows)))
            for idx, tokens, cost, requests in rows:
                args += [str(idx), str(tokens), str(cost), str(requests)]
        # Pipelined like the hot calls: after a restart every request finds its buckets lost at
        # once, and one connection per seed would exhaust the pool.
        keys = self.bucket_keys(call.bucket, call.windows)
        return bool(int(await self._batched("bucket_seed", keys, args)))

    async def inspect_bucket(self, call: BucketCheck, now_ms: int) -> BucketUsage:
        keys = self.bucket_keys(call.bucket, call.windows)
        args = [str(now_ms)]
        for w in call.windows:
            args += [str(w.slice_ms), "" if w.calendar is None else str(w.first_slice(now_ms))]
        values = [int(x) for x in await self._script("bucket_inspect", keys, args)]
        rows = tuple(
            WindowUsage(w, *values[3 + 3 * i : 6 + 3 * i]) for i, w in enumerate(call.windows)
        )
        return BucketUsage(call.bucket, values[0], values[1], rows, values[2])

    async def reset_bucket(self, bucket: Bucket, windows: Sequence[Rolling]) -> None:
        keys = self.bucket_keys(bucket, windows)[1:]
        if keys:
            await self._call(lambda: self._client.delete(*keys))

    async def buckets(self) -> list[Bucket]:
        """Every bucket with keys in Redis (for a reset of a whole scope; SCAN, not KEYS)."""
        found: set[Bucket] = set()

        async def scan() -> None:
            async for key in self._client.scan_iter(match=f"{self._prefix}:{{*}}:budget:*"):
                found_bucket = _bucket_of(key, len(self._prefix) + 2)
                if found_bucket is not None:
                    found.add(found_bucket)

        try:
            with anyio.fail_after(max(self._timeout * 20, 5.0)):
                await scan()
        except (RedisError, OSError, TimeoutError) as exc:
            raise store_error(exc) from exc
        return sorted(found, key=lambda b: (b.kind.value, b.subject))

    # -- provider capacity ------------------------------------------------------------------
    # Each key's state is one hash, ``{prefix}:{pool}:<encoded id>`` (the id, never a secret).
    # Every provider key shares the ``{pool}`` hash tag, so on a Cluster they live in one slot
    # and one script chooses among a request's candidates and reserves on the first with room.
    def pool_key(self, key_id: str) -> str:
        return f"{self._prefix}:{{{SHARED_SLOT}}}:{encode_id(key_id)}"

    async def register_key(self, key: ProviderKey) -> None:
        args = [key.provider, _opt(key.rpm), _opt(key.tpm)]
        await self._script("pool_register", [self.pool_key(key.id)], args)

    async def remove_key(self, key_id: str) -> None:
        name = self.pool_key(key_id)
        await self._call(lambda: self._client.delete(name))

    def acquire(self, key_ids: Sequence[str], tokens: int, now_ms: int) -> Awaitable[Acquired]:
        keys = [self.pool_key(k) for k in key_ids]
        args = [str(now_ms), str(tokens), str(RATE_WINDOW_MS)]
        return _acquired(self._batched("pool_acquire", keys, args))

    def settle_lease(
        self, key_id: str, window: int, reserved: int, actual: int | None, now_ms: int
    ) -> Awaitable[object]:
        return self.settle_leases(key_id, ((window, reserved, actual),), now_ms)

    def settle_leases(
        self, key_id: str, leases: Sequence[tuple[int, int, int | None]], now_ms: int
    ) -> Awaitable[object]:
        args = [str(now_ms), str(RATE_WINDOW_MS)]
        for window, reserved, actual in leases:
            args += [str(window), str(reserved), "-" if actual is None else str(actual)]
        return self._batched("pool_settle", [self.pool_key(key_id)], args)

    async def cooldown(self, key_id: str, until_ms: int) -> int | None:
        ends = int(await self._script("pool_cooldown", [self.pool_key(key_id)], [str(until_ms)]))
        return None if ends < 0 else ends

    async def key_state(self, key_id: str, now_ms: int) -> StoredKey | None:
        name = self.pool_key(key_id)
        fields = ["p", "tpm", "rpm", "w", "r", "t", "cu"]
        p, tpm, rpm, w, r, t, cu = await self._call(lambda: self._client.hmget(name, fields))
        if p is None:
            return None
        live = w is not None and int(w) == now_ms // RATE_WINDOW_MS
        return StoredKey(
            str(p),
            None if tpm is None else int(tpm),
            None if rpm is None else int(rpm),
            int(r or 0) if live else 0,
            int(t or 0) if live else 0,
            int(cu or 0),
        )

    async def ping(self) -> None:
        await self._call(self._client.ping)

    async def aclose(self) -> None:
        """Close every connection (the pipeline's and the client's pool); used again, the
        store connects again."""
        await self.pipeline.aclose()
        if isinstance(self._client, RedisCluster):
            await self._client.aclose()
        else:
            # client_for gives the client a pool of its own, which a plain aclose() leaves open.
            await self._client.aclose(close_connection_pool=True)


# The URL schemes client_for understands: one server, or a cluster through any seed node.
SERVER_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SCHEMES = SERVER_SCHEMES + CLUSTER_SCHEMES


def client_for(
    url: str, timeout: float, *, max_connections: int = 512
) -> aioredis.Redis | RedisCluster:
    """A redis-py client for ``url`` (``redis://``, ``rediss://``, ``unix://``, or
    ``redis+cluster://`` with any node as the seed); ``timeout`` bounds one round trip,
    connecting included. Budgets and the provider-key pool build theirs here too."""
    opts: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "decode_responses": True,
        "health_check_interval": 30,
    }
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigurationError(f"not a Redis URL: {url!r}")
    if scheme in CLUSTER_SCHEMES:
        base = scheme.split("+", 1)[0]
        client: aioredis.Redis | RedisCluster = RedisCluster.from_url(f"{base}://{rest}", **opts)
    elif scheme in SERVER_SCHEMES:
        # The hot path's batches use connections of their own (pipeline.py); this pool
        # serves the other calls. A blocking pool: when every connection is busy a call
        # waits (bounded by the timeout) instead of failing at once. redis-py's default
        # pool raises beyond 100 connections in flight, which fail-closed would turn into
        # 503s under load.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout,
            # One quick retry on a fresh connection: after a server restart the pool's
            # sockets are dead, and the first command on each would otherwise fail. Only
            # a broken connection is retried; a timeout is not: a request's wait stays
            # bounded. (The pipeline's own connections follow the same rule.)
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
            **opts,
        )
        client = aioredis.Redis(connection_pool=pool)
    else:
        raise ConfigurationError(
            f"unsupported Redis URL scheme {scheme!r}: use redis://, rediss://, unix:// "
            "or redis+cluster://"
        )
    return client


def _took(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and int(reply[0]) == 1


_Marks = tuple[str | None, ...] | None  # a bucket check's windows' alert thresholds


async def _fired(calls: Sequence[Awaitable[Any]]) -> list[int]:
    """How many alerts each commit fired (a commit without thresholds: 0)."""
    return [int(r[1]) if isinstance(r, list) else 0 for r in await _gather(calls)]


async def _fired_one(call: Awaitable[Any]) -> int:
    reply = await call
    return int(reply[1]) if isinstance(reply, list) else 0


async def _gather(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """Every call's reply; the calls were all submitted first, so they share a pipeline (on a
    cluster, one per node, in parallel). The first failure is raised once all have ended."""
    replies: list[Any] = []
    error: BaseException | None = None
    for call in calls:
        try:
            replies.append(await call)
        except Exception as exc:
            error = error or exc
            replies.append(None)
    if error is not None:
        raise error
    return replies


async def _acquired(reply: Awaitable[Any]) -> Acquired:
    raw = [int(x) for x in await reply]
    if raw[0] == 1:
        return Acquired(raw[1] - 1, raw[2])
    refused = []
    for code, n in zip(raw[1::2], raw[2::2], strict=True):
        refusal = _REFUSALS[code]
        frees = refusal in (Refusal.COOLING, Refusal.FULL)
        refused.append(Attempt(refusal, free_at_ms=n if frees else None))
    return Acquired(None, refused=tuple(refused))


def _bounded(
    windows: Sequence[Rolling], wire: list[str], now_ms: int, step: int, reset: bool
) -> list[str]:
    """A bucket's window arguments with each calendar window's oldest slice (and, with
    ``reset``, its reset) as of ``now_ms``: they move with the calendar, so they are made per
    call (after the slice length, ``step`` arguments a window)."""
    out = list(wire)
    for i, w in enumerate(windows):
        if w.calendar is not None:
            out[i * step + 1] = str(w.first_slice(now_ms))
            if reset:
                out[i * step + 2] = str(w.reset_ms(now_ms))
    return out


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


@lru_cache(maxsize=4096)
def _marks(marks: tuple[int, tuple[tuple[int, int], ...]] | None) -> str:
    if marks is None or not marks[1]:
        return ""
    limit, at = marks
    return f"{_uint(limit)} " + " ".join(f"{_uint(p)}:{_uint(a)}" for p, a in at)


def _uint(value: int) -> str:
    # Integer micro-USD only, sent as decimal strings: never a float near the wire.
    if type(value) is int and value >= 0:
        return str(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"amount must be a non-negative integer of micro-USD, got {value!r}")
    return str(value)


async def _as_int(call: Awaitable[Any]) -> int:
    return int(await call)
