"""Charging an admitted inference once, however it ended: ``shielded`` runs work to its end
although its task is cancelled, and the embedded store's charge, which never suspends, takes
that path instead of a cancel scope on every request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from starlette.types import Message

from spendguard import Settings, SpendGuardMiddleware
from spendguard.asgi.request import parse_request
from spendguard.engine.guard import SpendGuard
from spendguard.engine.round import shielded
from spendguard.identity import Identity
from spendguard.limits import Period, key_limit
from spendguard.store.memory import MemoryStore
from spendguard.usage import Dialect
from tests.support import Clock, StateAuth, chat_body, raw_call, upstream, write_unit_prices

pytestmark = pytest.mark.anyio

ALPHA = Identity("acme", "alpha")


# -- shielded ---------------------------------------------------------------------------------


async def test_work_that_never_suspends_runs_whole_in_a_cancelled_scope() -> None:
    steps: list[str] = []

    async def charge() -> int:
        steps.append("charged")
        return 7

    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await shielded(charge()) == 7
    assert steps == ["charged"]


async def test_work_that_suspends_finishes_although_its_task_is_cancelled() -> None:
    steps: list[str] = []

    async def charge() -> str:
        for i in range(3):
            await anyio.sleep(0.01)  # a store awaiting I/O: where a cancellation would land
            steps.append(f"step {i}")
        return "charged"

    results: list[str] = []

    async def request() -> None:
        try:
            await anyio.sleep(10)  # the app, until the request is cancelled
        finally:
            results.append(await shielded(charge()))

    with anyio.move_on_after(0.05):
        await request()
    assert results == ["charged"]
    assert steps == ["step 0", "step 1", "step 2"]


async def test_the_same_work_awaited_plainly_is_cancelled() -> None:
    # The counterpart of the test above: what shielded() prevents.
    steps: list[str] = []

    async def charge() -> None:
        for i in range(3):
            await anyio.sleep(0.01)
            steps.append(f"step {i}")

    async def request() -> None:
        try:
            await anyio.sleep(10)
        finally:
            await charge()

    with anyio.move_on_after(0.05):
        await request()
    assert steps == []


async def test_a_scope_the_work_enters_after_suspending_nests_inside() -> None:
    async def charge() -> str:
        await anyio.lowlevel.checkpoint()
        with anyio.move_on_after(0.01):  # a deadline of the work's own
            await anyio.sleep(10)
            return "slow"
        return "timed out, handled"

    assert await shielded(charge()) == "timed out, handled"


@pytest.mark.parametrize("suspends_first", [False, True])
async def test_errors_reach_the_caller(suspends_first: bool) -> None:
    async def charge() -> None:
        if suspends_first:
            await anyio.lowlevel.checkpoint()
        raise LookupError("store refused")

    with pytest.raises(LookupError, match="store refused"):
        await shielded(charge())


# -- the embedded store's charge --------------------------------------------------------------


class _SlowMemoryStore(MemoryStore):
    """The embedded store, but its postflight suspends (as no real one does)."""

    async def postflight(self, *args: Any, **kwargs: Any) -> int:
        await anyio.sleep(0.01)
        return await super().postflight(*args, **kwargs)


def _guard(tmp_path: Path, store_class: type[MemoryStore] = MemoryStore) -> SpendGuard:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}", prices=write_unit_prices(tmp_path)
    )
    clock = Clock()
    return SpendGuard(settings, store=store_class(clock=clock), clock=clock)


def _suspend_postflight(store: MemoryStore) -> None:
    """Make this embedded store's postflight suspend, the store still of its own class: the
    guard still expects it to finish in place, and shielded() must cover it."""
    real = store.postflight

    async def slow(*args: Any, **kwargs: Any) -> int:
        await anyio.sleep(0.01)
        return await real(*args, **kwargs)

    store.postflight = slow  # type: ignore[method-assign]


@pytest.fixture
async def guard(tmp_path: Path) -> AsyncIterator[SpendGuard]:
    guard = _guard(tmp_path)
    await guard.start(worker=False)
    try:
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1)
        yield guard
    finally:
        await guard.stop()


@pytest.mark.parametrize("status", [200, 502])
async def test_the_embedded_store_finishes_without_suspending(
    guard: SpendGuard, status: int
) -> None:
    # What lets the middleware skip the cancel scope: charging (200) or releasing (502) an
    # admitted inference completes in its first step.
    assert guard.finishes_in_place
    body = json.dumps(chat_body()).encode()
    admission = await guard.admit(
        ALPHA, parse_request(body), route="/v1/chat/completions", dialect=Dialect.OPENAI
    )
    assert admission.allowed
    observer = guard.observe(admission, status, "application/json", None)
    if observer is not None:
        usage = {"prompt_tokens": 10, "completion_tokens": 5}
        observer.feed(json.dumps({"model": "unit-model", "usage": usage}).encode())
    work = guard.finish(admission, status, observer)
    with pytest.raises(StopIteration) as done:
        work.send(None)
    record = done.value.value
    assert (record is not None) == (status == 200)
    if record is not None:
        assert (record.usage.input_tokens, record.usage.output_tokens) == (10, 5)


async def test_only_a_running_embedded_store_counts_as_finishing_in_place(
    tmp_path: Path,
) -> None:
    guard = _guard(tmp_path)
    assert not guard.finishes_in_place  # no lifespan yet: a record is written through
    await guard.start(worker=False)
    try:
        assert guard.finishes_in_place
    finally:
        await guard.stop()
    assert not _guard(tmp_path, _SlowMemoryStore).finishes_in_place  # a subclass may await


@pytest.mark.parametrize("store", ["embedded", "suspending in place", "suspending subclass"])
async def test_a_cancelled_request_on_the_embedded_store_is_charged_once(
    tmp_path: Path, store: str
) -> None:
    guard = _guard(tmp_path, _SlowMemoryStore if store == "suspending subclass" else MemoryStore)
    if store == "suspending in place":
        assert isinstance(guard.store, MemoryStore)
        _suspend_postflight(guard.store)
    app = StateAuth(SpendGuardMiddleware(upstream(), guard=guard))
    await guard.start(worker=False)
    try:
        await guard.admin.set_policy("acme", "alpha", window=Period.DAY, limit_usd=1)
        # A streamed request whose upstream hangs after one chunk, cancelled from outside.
        body = json.dumps(chat_body(stream=True, x_stall_at=1)).encode()
        sent: list[Message] = []
        with anyio.move_on_after(0.3):
            await raw_call(app, body, sent=sent)
        assert sent[0]["status"] == 200  # the response started, then the request was cancelled
        await guard.recorder.flush()
        count, estimate = await guard.ledger.unsettled()
        assert count == 1 and estimate > 0
        day = guard.codec.check(key_limit(ALPHA, Period.DAY), guard.clock()).usage_key
        assert await guard.store.read_usage([day]) == {day: estimate}  # the cache has it too
    finally:
        await guard.stop()
