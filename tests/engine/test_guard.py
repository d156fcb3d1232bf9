"""Tests for spendguard.engine.guard: SpendGuard admits, observes and finishes one inference.

The real parts: the embedded store on a settable clock and a real ledger (SQLite and
PostgreSQL). Faults are injected by wrapping them (``Override``), never by reaching inside.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from spendguard import Settings, SpendGuard
from spendguard.engine.decision import Admission, InferenceRequest, Unavailable, Verdict
from spendguard.engine.guard import new_record_id
from spendguard.errors import LedgerUnavailable, StoreUnavailable
from spendguard.identity import Identity
from spendguard.ledger import Ledger
from spendguard.limits import Period, Policy, key_limit
from spendguard.record import PostflightStatus
from spendguard.store.memory import MemoryStore
from spendguard.usage import Dialect, Usage
from tests.support import UNIT_MODEL, Clock, Exploding, Override
from tests.support.bodies import sse

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")
KEY_DAY = key_limit(ALPHA, Period.DAY)
ROUTE = "/v1/chat/completions"
SERVED = "served-model"  # priced at 2 micro-USD per token: "what was served" shows in the charge
ROUTED = "routed-model"  # 3 micro-USD per token: the model the gateway says it routed to
REQUEST = InferenceRequest(UNIT_MODEL, stream=False, max_tokens=None, estimated_input_tokens=7)
CLOCK = Clock()  # 2026-09-30 12:00 UTC for every guard and store here (no test moves it)


def memory_store(**options: Any) -> MemoryStore:
    return MemoryStore(clock=CLOCK, **options)


def write_prices(directory: Path) -> Path:
    path = directory / "prices.json"
    models = {
        UNIT_MODEL: {"input": "1", "output": "1"},
        SERVED: {"input": "2", "output": "2"},
        ROUTED: {"input": "3", "output": "3"},
        "default": {"input": "1", "output": "1"},
    }
    path.write_text(json.dumps({"as_of": "2026-11-01", "models": models}))
    return path


Build = Callable[..., SpendGuard]


@pytest.fixture
async def build(database_url: str, tmp_path: Path) -> AsyncIterator[Build]:
    """Build started guards on the test's database: ``build(store=..., ledger=..., **settings)``."""
    guards: list[SpendGuard] = []

    def make(store: Any = None, ledger: Any = None, **settings: Any) -> SpendGuard:
        guard = SpendGuard(
            Settings(database_url=database_url, prices=write_prices(tmp_path), **settings),
            store=store if store is not None else memory_store(),
            ledger=ledger if ledger is not None else Ledger(database_url),
            clock=CLOCK,
        )
        guards.append(guard)
        return guard

    yield make
    for guard in reversed(guards):
        if guard.running:
            await guard.stop()


async def started(guard: SpendGuard) -> SpendGuard:
    await guard.start(worker=False)
    return guard


async def set_limit(guard: SpendGuard, micros: int) -> None:
    await guard.ledger.set_policy(Policy(KEY_DAY, micros, "acme", "alpha"), now=guard.clock())


async def admit(guard: SpendGuard, request: InferenceRequest = REQUEST, **kw: Any) -> Admission:
    return await guard.admit(ALPHA, request, route=ROUTE, dialect=Dialect.OPENAI, **kw)


async def day_usage(guard: SpendGuard) -> int | None:
    key = guard.codec.check(KEY_DAY, guard.clock()).usage_key
    return (await guard.store.read_usage([key]))[key]


def chat_response(prompt: int, completion: int, model: str = UNIT_MODEL) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return json.dumps({"model": model, "choices": [], "usage": usage}).encode()


# -- admit ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "verdict"), [("reject", Verdict.UNAUTHENTICATED), ("allow", Verdict.PASS)]
)
async def test_no_identity_passes_or_is_unauthenticated_by_setting(
    build: Build, setting: str, verdict: Verdict
) -> None:
    guard = build(Exploding("store"), Exploding("ledger"), missing_identity=setting)
    admission = await guard.admit(None, None, route=ROUTE, dialect=Dialect.ANTHROPIC)
    assert admission.verdict is verdict and not admission.allowed
    assert admission.decision is None and admission.dialect is Dialect.ANTHROPIC
    assert guard.observe(admission, 200, "application/json", None) is None
    assert await guard.finish(admission, 200, None) is None  # not limited, not recorded


async def test_an_identified_inference_needs_its_request(build: Build) -> None:
    guard = build(Exploding("store"), Exploding("ledger"))
    with pytest.raises(TypeError):
        await guard.admit(ALPHA, None, route=ROUTE, dialect=Dialect.OPENAI)


async def test_an_unpriced_model_is_refused_before_any_lookup_when_so_configured(
    build: Build,
) -> None:
    guard = build(Exploding("store"), Exploding("ledger"), unknown_model="reject")
    mystery = InferenceRequest("mystery-model", False, None, 1)
    admission = await admit(guard, mystery)
    assert admission.verdict is Verdict.UNPRICED and "mystery-model" in admission.message
    assert admission.decision is None


async def test_an_unpriced_model_is_checked_as_usual_by_default(build: Build) -> None:
    guard = await started(build())
    admission = await admit(guard, InferenceRequest("mystery-model", False, None, 1))
    assert admission.verdict is Verdict.ALLOW


async def test_allow_under_the_limit_and_deny_at_it(build: Build) -> None:
    guard = await started(build())
    await set_limit(guard, 10)
    allowed = await admit(guard)
    assert allowed.verdict is Verdict.ALLOW and allowed.allowed
    assert allowed.decision is not None and allowed.decision.retry_after is None
    assert [s.check.target for s in allowed.decision.limits] == [KEY_DAY]
    await guard.finish(allowed, 200, None)  # 7 estimated input tokens: 7 micro-USD
    await guard.finish(await admit(guard), 200, None)  # 14 >= 10 from here on
    denied = await admit(guard)
    assert denied.verdict is Verdict.DENY and not denied.allowed
    assert denied.decision is not None and denied.decision.denied_limit == KEY_DAY
    # Noon: twelve hours to the day's reset.
    assert denied.decision.retry_after == 12 * 3600


async def test_no_policy_allows_with_nothing_to_charge(build: Build) -> None:
    guard = await started(build())
    admission = await admit(guard)
    assert admission.verdict is Verdict.ALLOW
    assert admission.decision is not None and admission.decision.limits == ()


async def test_a_retry_keeps_its_t0_and_inference_id(build: Build) -> None:
    guard = await started(build())
    t0 = datetime(2026, 9, 30, 11, tzinfo=UTC)
    admission = await admit(guard, t0=t0, inference_id="inf-1")
    assert admission.decision is not None
    assert admission.decision.t0 == t0 and admission.decision.inference_id == "inf-1"
    assert admission.decision.record_id != "inf-1"  # each attempt is its own record
    fresh = (await admit(guard)).decision
    assert fresh is not None and fresh.inference_id == fresh.record_id and fresh.t0 == guard.clock()


async def unreachable(*args: object, **kwargs: object) -> Any:
    raise StoreUnavailable("connection refused")


async def test_fail_open_allows_and_tracks_what_the_outage_let_through(build: Build) -> None:
    store = Override(memory_store(), preflight=unreachable)
    guard = await started(build(store, fail_mode="open"))
    admission = await admit(guard)
    assert admission.verdict is Verdict.ALLOW
    assert admission.decision is not None and admission.decision.fail_open
    assert admission.decision.unavailable is None
    record = await guard.finish(admission, 200, None)
    assert record is not None and record.postflight is PostflightStatus.SKIPPED  # no keys
    assert guard.outage.spent(ALPHA) == (1, 7)


async def test_fail_open_still_refuses_what_it_knows_to_be_over_a_limit(build: Build) -> None:
    """The last usage the store reported plus what the outage let through, per key: a key
    known to be at its limit gets the limit's 429, not a free pass."""
    store = Override(memory_store())
    guard = await started(build(store, fail_mode="open"))
    await set_limit(guard, 7 * 4)  # four requests of 7 micro-USD
    first = await admit(guard)  # the store answers: usage 0 of 28, remembered
    assert first.verdict is Verdict.ALLOW and not first.decision.fail_open  # type: ignore[union-attr]
    await guard.finish(first, 200, None)  # 7 charged in the store
    store.preflight = unreachable  # type: ignore[attr-defined]
    verdicts = []
    for _ in range(5):
        admission = await admit(guard)
        verdicts.append(admission.verdict)
        await guard.finish(admission, 200, None)
    # Known: usage 0 at the last answer plus the 7 charged after it; 3 more fit in 28.
    assert verdicts == [Verdict.ALLOW] * 3 + [Verdict.DENY] * 2
    denied = (await admit(guard)).decision
    assert denied is not None and denied.denied_limit == KEY_DAY
    assert denied.retry_after == 12 * 3600  # the day's reset, as for any limit's 429
    # An identity never checked before the outage can only be counted, not enforced.
    other = await guard.admit(Identity("globex", "k"), REQUEST, route=ROUTE, dialect=Dialect.OPENAI)
    assert other.verdict is Verdict.ALLOW and other.decision is not None
    assert other.decision.fail_open


async def test_fail_closed_is_unavailable_naming_the_store(build: Build) -> None:
    guard = await started(build(Override(memory_store(), preflight=unreachable)))
    admission = await admit(guard)
    assert admission.verdict is Verdict.UNAVAILABLE
    assert admission.decision is not None
    assert admission.decision.unavailable is Unavailable.STORE
    assert admission.decision.retry_after == 1 and not admission.decision.fail_open
    assert len(guard.outage) == 0


async def test_fail_open_is_bounded_by_the_tracker(build: Build) -> None:
    store = Override(memory_store(), preflight=unreachable)
    guard = await started(build(store, fail_mode="open", fail_open_max_keys=1))
    assert (await admit(guard)).verdict is Verdict.ALLOW
    other = await guard.admit(
        Identity("acme", "beta"), REQUEST, route=ROUTE, dialect=Dialect.OPENAI
    )
    assert other.verdict is Verdict.UNAVAILABLE
    assert other.decision is not None and other.decision.unavailable is Unavailable.STORE


async def test_a_full_store_is_unavailable_never_allowed_untracked(build: Build) -> None:
    guard = await started(build(memory_store(max_keys=1), fail_mode="open"))
    await set_limit(guard, 10**6)
    admission = await admit(guard)
    assert admission.verdict is Verdict.UNAVAILABLE
    assert admission.decision is not None
    assert admission.decision.unavailable is Unavailable.STORE_FULL


async def test_a_ledger_down_on_a_cache_miss_is_unavailable_naming_the_ledger(
    build: Build, database_url: str
) -> None:
    async def down(*args: object) -> Any:
        raise LedgerUnavailable("connection refused")

    ledger = Override(Ledger(database_url), load_limits=down)
    guard = await started(build(ledger=ledger))
    admission = await admit(guard)
    assert admission.verdict is Verdict.UNAVAILABLE
    assert admission.decision is not None
    assert admission.decision.unavailable is Unavailable.LEDGER
    assert admission.decision.retry_after == 1


async def test_keys_that_vanish_on_every_fill_are_unavailable(build: Build) -> None:
    async def lost(*args: object, **kwargs: object) -> None:
        pass  # the fill never sticks: evicted as fast as it is written

    guard = await started(build(Override(memory_store(), fill=lost)))
    admission = await admit(guard)
    assert admission.verdict is Verdict.UNAVAILABLE
    assert admission.decision is not None
    assert admission.decision.unavailable is Unavailable.VANISHED


# -- observe --------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 204, 206, 299])
async def test_observe_gives_an_observer_for_any_2xx(build: Build, status: int) -> None:
    guard = await started(build())
    assert guard.observe(await admit(guard), status, "application/json", None) is not None


@pytest.mark.parametrize("status", [0, 199, 301, 400, 429, 500, 503])
async def test_observe_is_none_for_a_response_that_is_not_charged(
    build: Build, status: int
) -> None:
    guard = await started(build())
    assert guard.observe(await admit(guard), status, "application/json", None) is None


async def test_observe_reads_the_body_in_the_admissions_dialect_and_encoding(
    build: Build,
) -> None:
    guard = await started(build())
    observer = guard.observe(await admit(guard), 200, "text/event-stream", "identity")
    assert observer is not None
    observer.feed(sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    assert observer.result() == Usage(input_tokens=3, output_tokens=2)


# -- finish ---------------------------------------------------------------------------------


async def test_finish_charges_once_into_the_cache_and_the_ledger(build: Build) -> None:
    guard = await started(build())
    await set_limit(guard, 10**6)
    admission = await admit(guard)
    observer = guard.observe(admission, 200, "application/json", None)
    assert observer is not None
    observer.feed(chat_response(10, 5))
    record = await guard.finish(admission, 200, observer)
    assert record is not None and record.postflight is PostflightStatus.APPLIED
    assert (record.usage, record.estimate_micros) == (Usage(input_tokens=10, output_tokens=5), 15)
    again = await guard.finish(admission, 200, observer)  # a second finish of the same one
    assert again is not None and again.postflight is PostflightStatus.SKIPPED
    assert await day_usage(guard) == 15
    await guard.recorder.flush()
    assert await guard.ledger.unsettled() == (1, 15)  # one record, written once


@pytest.mark.parametrize("status", [0, 400, 500])
async def test_finish_charges_nothing_for_a_response_that_failed(build: Build, status: int) -> None:
    guard = await started(build())
    await set_limit(guard, 10**6)
    admission = await admit(guard)
    assert await guard.finish(admission, status, None) is None
    assert await day_usage(guard) == 0  # filled by the admission, never charged
    await guard.recorder.flush()
    assert await guard.ledger.unsettled() == (0, 0)


async def test_finish_without_usage_estimates_from_the_request(build: Build) -> None:
    guard = await started(build())
    record = await guard.finish(await admit(guard), 200, None)
    assert record is not None and record.usage.estimated
    assert record.usage.input_tokens == REQUEST.estimated_input_tokens


async def test_finish_charges_the_model_that_was_served(build: Build) -> None:
    guard = await started(build())
    admission = await admit(guard)
    observer = guard.observe(admission, 200, "application/json", None)
    assert observer is not None
    observer.feed(chat_response(10, 5, model=SERVED))
    record = await guard.finish(admission, 200, observer)
    assert record is not None and record.model == SERVED and record.estimate_micros == 30


PINNED = InferenceRequest(UNIT_MODEL, False, None, 7, model_pinned=True)  # a deployment path's


@pytest.mark.parametrize(
    ("request_", "routed", "response", "charged"),
    [
        (REQUEST, ROUTED, SERVED, ROUTED),  # the router's word first
        (PINNED, ROUTED, SERVED, ROUTED),  # even over a deployment path's model
        (PINNED, None, SERVED, UNIT_MODEL),  # the path's model over the response's
        (REQUEST, None, SERVED, SERVED),  # the response's, where it is priced
        (REQUEST, None, "unpriced-echo", UNIT_MODEL),  # else the request's
        (REQUEST, "unpriced-route", SERVED, SERVED),  # an unpriced route: the rest decides
        (PINNED, "unpriced-route", SERVED, UNIT_MODEL),
    ],
    ids=["routed", "routed-over-path", "path", "response", "request", "unpriced", "unpriced-path"],
)
async def test_finish_charges_the_routed_then_the_path_then_the_served_then_the_requested_model(
    build: Build, request_: InferenceRequest, routed: str | None, response: str, charged: str
) -> None:
    guard = await started(build())
    admission = await admit(guard, request_)
    observer = guard.observe(admission, 200, "application/json", None)
    assert observer is not None
    observer.feed(chat_response(10, 5, model=response))
    record = await guard.finish(admission, 200, observer, routed=routed)
    per_token = {UNIT_MODEL: 1, SERVED: 2, ROUTED: 3}[charged]
    assert record is not None and (record.model, record.estimate_micros) == (
        charged,
        15 * per_token,
    )


async def test_an_unpriced_route_is_warned_about_once(
    build: Build, caplog: pytest.LogCaptureFixture
) -> None:
    guard = await started(build())
    for _ in range(2):
        record = await guard.finish(await admit(guard), 200, None, routed="unpriced-route")
        assert record is not None and record.model == UNIT_MODEL
    warned = [r for r in caplog.records if "unpriced-route" in r.getMessage()]
    assert len(warned) == 1 and "charged as 'unit-model'" in warned[0].getMessage()


async def test_prices_swapped_while_running_reach_finish_and_settlement(build: Build) -> None:
    guard = await started(build())
    admission = await admit(guard, InferenceRequest("team-alias", False, None, 7))
    guard.use_prices(guard.prices.with_aliases({"team-alias": ROUTED}))
    record = await guard.finish(admission, 200, None)  # admitted before, finished after
    assert record is not None and record.model == "team-alias"
    assert record.estimate_micros == 3 * 7 and guard.coster.is_priced("team-alias")
    await guard.recorder.flush()
    await guard.worker.run_once()  # the worker shares the coster: the same price settles
    assert await guard.ledger.charges_total() == 21


def test_record_ids_are_unique_and_grow_with_time() -> None:
    """Ids are 32 hex digits that sort by the millisecond they were drawn in (the ledger's
    primary key then appends instead of landing on a random page), and never repeat."""
    same_ms = [new_record_id() for _ in range(10_000)]
    assert len(set(same_ms)) == len(same_ms)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in same_ms)
    first = new_record_id()
    time.sleep(0.003)
    later = new_record_id()
    assert later[:12] > first[:12] and later > first
    assert abs(int(later[:12], 16) - time.time_ns() // 1_000_000) < 1_000
