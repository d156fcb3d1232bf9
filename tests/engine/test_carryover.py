"""The carryover of shared-slot finishing writes (engine/carryover.py): what waits, when a
finishing round carries it, in what groups, and what the records writer waits for before
removing entries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spendguard.engine.carryover import RIDE_AT, Carryover

pytestmark = pytest.mark.anyio


class Writes:
    """Group sends that record what they send and land when the test says so."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[Any]]] = []
        self.replies: list[asyncio.Future[None]] = []

    def to(self, group: str, fail: bool = False) -> Any:
        def send_all(items: list[Any]) -> asyncio.Future[None]:
            if fail:
                raise RuntimeError("a bug while sending")
            self.sent.append((group, items))
            reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.replies.append(reply)
            return reply

        return send_all

    def land(self) -> None:
        for reply in self.replies:
            if not reply.done():
                reply.set_result(None)


async def test_a_finishing_round_carries_every_group_once_enough_requests_wait() -> None:
    carry, writes = Carryover(), Writes()
    for i in range(RIDE_AT - 1):
        # A request leaves writes in two groups (a bucket's commit, a key's settlement): it
        # counts as one request.
        carry.add_to("model", f"commit {i}", writes.to("model"), f"r{i}")
        carry.add_to("lease", f"settle {i}", writes.to("lease"), f"r{i}")
        assert carry.rider() is None
    assert writes.sent == [] and len(carry) == 2
    carry.add_to("model", "commit last", writes.to("model"), "last")
    rider = carry.rider()
    assert rider is not None
    # Sent by the call, so that they join the caller's pipeline write: one send per group,
    # with every item of the group, in the order they came.
    assert writes.sent == [
        ("model", [*(f"commit {i}" for i in range(RIDE_AT - 1)), "commit last"]),
        ("lease", [f"settle {i}" for i in range(RIDE_AT - 1)]),
    ]
    assert len(carry) == 0 and carry.rider() is None
    # Their admissions' entries stay until the replies are in.
    assert carry.waiting(["r0"]) and carry.waiting(["last"]) and not carry.waiting(["other"])
    writes.land()
    await rider
    assert not carry.waiting(["r0", "last"])


async def test_settle_sends_what_waits_and_waits_for_what_is_in_flight() -> None:
    carry, writes = Carryover(), Writes()
    for i in range(RIDE_AT):
        carry.add_to("model", i, writes.to("model"), f"e{i}")
    rider = carry.rider()  # in flight, its carrier not done yet
    assert rider is not None
    carry.add_to("model", "late", writes.to("model"), "late")
    riding = asyncio.ensure_future(rider)
    settling = asyncio.ensure_future(carry.settle())
    await asyncio.sleep(0)
    assert writes.sent[-1] == ("model", ["late"])  # at once, not left for a round to come
    assert not settling.done() and carry.sent_alone == 1
    writes.land()
    await settling
    assert riding.done() and not carry.waiting([*(f"e{i}" for i in range(RIDE_AT)), "late"])


async def test_a_group_that_fails_to_send_loses_none_of_the_others() -> None:
    carry, writes = Carryover(), Writes()
    carry.add_to("broken", "x", writes.to("broken", fail=True), "a")
    for i in range(RIDE_AT - 1):
        carry.add_to("fine", i, writes.to("fine"), f"b{i}")
    rider = carry.rider()
    assert rider is not None and writes.sent == [("fine", list(range(RIDE_AT - 1)))]
    writes.land()
    await rider
    assert not carry.waiting(["a", "b0"])
