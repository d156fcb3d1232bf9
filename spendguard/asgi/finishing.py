"""What the middleware and the deferred path both do around the app of an admitted inference:
hand it the body already read, and charge the inference once when it ends."""

from __future__ import annotations

import anyio
from starlette.types import Message, Receive

from ..budgets import BudgetAdmission, BudgetGate
from ..engine.decision import Admission
from ..engine.guard import SpendGuard
from ..usage import BodyObserver

__all__ = ["finish", "replay"]


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` for the app: first the body spendguard already consumed, then the real
    one (so the app still sees ``http.disconnect``)."""
    sent = False

    async def replay_receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


async def finish(
    guard: SpendGuard,
    budgets: BudgetGate | None,
    admission: Admission,
    status_code: int,
    observer: BodyObserver | None,
    budget: BudgetAdmission | None,
) -> None:
    """Charge an admitted inference, however the app ended: return, exception, disconnect or
    cancellation. Shielded, so a cancelled request still settles its charge; bounded by the
    store's own timeouts, so no deadline of ours is needed. Its budget hold becomes what was
    charged, or is returned when nothing was."""
    with anyio.CancelScope(shield=True):
        record = await guard.finish(admission, status_code, observer)
        if budget is not None and budgets is not None:
            if record is None:
                await budgets.finish(budget, None, budget.model)
            else:
                await budgets.finish(budget, record.usage, record.model)
