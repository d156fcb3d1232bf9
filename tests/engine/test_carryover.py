"""The carryover of shared-slot finishing writes (engine/carryover.py): what waits, when a
finishing round carries it, and what the records writer waits for before removing entries."""

from __future__ import annotations

import asyncio

import pytest

from spendguard.engine.carryover import RIDE_AT, Carryover, Send

pytestmark = pytest.mark.anyio


class Writes:
    """Writes that record when they are sent and land when the test says so."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.replies: dict[str, asyncio.Future[None]] = {}

    def write(self, name: str, fail: bool = False) -> Send:
        def send() -> asyncio.Future[None]:
            if fail:
                raise RuntimeError("a bug while sending")
            self.sent.append(name)
            reply = self.replies[name] = asyncio.get_running_loop().create_future()
            return reply

        return send

    def land(self) -> None:
        for reply in self.replies.values():
            if not reply.done():
                reply.set_result(None)


async def test_a_finishing_round_carries_the_writes_once_enough_requests_wait() -> None:
    carry, writes = Carryover(), Writes()
    for i in range(RIDE_AT - 1):
        # A request may leave two writes (a commit and a lease's settlement): one request.
        carry.add(writes.write(f"commit {i}"), f"r{i}")
        carry.add(writes.write(f"settle {i}"), f"r{i}")
        assert carry.rider() is None
    assert writes.sent == [] and len(carry) == 2 * (RIDE_AT - 1)
    carry.add(writes.write("commit last"), "last")
    rider = carry.rider()
    assert rider is not None
    # Sent by the call, so that they join the caller's pipeline write; none is left waiting.
    assert len(writes.sent) == 2 * RIDE_AT - 1 and len(carry) == 0
    assert carry.rider() is None
    # Their admissions' entries stay until the replies are in.
    assert carry.waiting(["r0"]) and carry.waiting(["last"]) and not carry.waiting(["other"])
    writes.land()
    await rider
    assert not carry.waiting(["r0", "last"])


async def test_settle_sends_what_waits_and_waits_for_what_is_in_flight() -> None:
    carry, writes = Carryover(), Writes()
    for i in range(RIDE_AT):
        carry.add(writes.write(f"early {i}"), f"e{i}")
    rider = carry.rider()  # in flight, its carrier not done yet
    assert rider is not None
    carry.add(writes.write("late"), "late")
    riding = asyncio.ensure_future(rider)
    settling = asyncio.ensure_future(carry.settle())
    await asyncio.sleep(0)
    assert "late" in writes.sent  # sent at once, not left for a round that may not come
    assert not settling.done()
    writes.land()
    await settling
    assert riding.done() and not carry.waiting([*(f"e{i}" for i in range(RIDE_AT)), "late"])


async def test_a_write_that_fails_to_send_loses_none_of_the_others() -> None:
    carry, writes = Carryover(), Writes()
    carry.add(writes.write("broken", fail=True), "a")
    for i in range(RIDE_AT - 1):
        carry.add(writes.write(f"fine {i}"), f"b{i}")
    rider = carry.rider()
    assert rider is not None and len(writes.sent) == RIDE_AT - 1
    writes.land()
    await rider
    assert not carry.waiting(["a", "b0"])
