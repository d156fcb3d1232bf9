"""Provider keys chosen at admission: the gateway declares a request's candidates, and the lease
on one of them is taken in the admission's round trip and settled in the finishing one.

Candidates come from a hook the gateway gives the middleware (``candidates=``: the request's
model and identity in, key ids out, or None for none) or from ``provider_candidates`` in the
settings (model globs to ids; the first glob that matches decides). The lease reaches the app
as ``request.state.spendguard_provider_key``; a router that fails over on a provider's 429 puts
the key in a cooldown, releases the lease and acquires another with the pool's own API (the
late choice), settling that one itself. The lease spendguard took is settled by spendguard,
unless the app settled or released it first.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from functools import partial
from typing import TYPE_CHECKING

from ..identity import Identity
from .model import Lease, NoCapacity
from .pool import ProviderPool

if TYPE_CHECKING:
    from ..engine.carryover import Carryover

log = logging.getLogger("spendguard")

STATE_PROVIDER_KEY = "spendguard_provider_key"
"""Where the app finds the :class:`~spendguard.providers.Lease` spendguard took for it."""

Candidates = Callable[[str, Identity], Sequence[str] | None]
"""A gateway's hook: the provider key ids, in order, an inference of ``model`` may use."""


def candidates_of(globs: Mapping[str, Sequence[str]]) -> Candidates:
    """The hook for ``provider_candidates``: the first glob (case-insensitive) that matches."""
    table = [(glob.lower(), tuple(ids)) for glob, ids in globs.items()]
    memo: dict[str, tuple[str, ...] | None] = {}

    def candidates(model: str, identity: Identity) -> Sequence[str] | None:
        if model in memo:
            return memo[model]
        name = model.lower()
        found = next((ids for glob, ids in table if fnmatchcase(name, glob)), None)
        if len(memo) < 10_000:
            memo[model] = found
        return found

    return candidates


class ProviderRouting:
    """The pool and the hook, as the middleware uses them: one lease per admitted inference."""

    def __init__(self, pool: ProviderPool, candidates: Candidates) -> None:
        self.pool = pool
        self.candidates = candidates

    def begin(
        self, model: str, identity: Identity, tokens: int
    ) -> Awaitable[Lease | NoCapacity] | None:
        """The lease's store call, sent now (None: no candidates for this request)."""
        ids = self.candidates(model, identity)
        if not ids:
            return None
        return self.pool.begin(ids, tokens=tokens)

    def finish_soon(self, lease: Lease, tokens: int | None) -> Awaitable[object]:
        """Settle (``tokens`` the call used) or release (None) the lease, sent now."""
        return self.pool.settle_soon(lease, tokens)

    def finish_later(self, lease: Lease, tokens: int, carry: Carryover, record_id: str) -> bool:
        """Settle the lease with ``tokens``, carried (engine/carryover.py) with the other
        settlements on its key: True when it is. False: the pool counts in this process
        (nothing would leave, so nothing waits; :meth:`finish_soon` it), or the lease was
        finished already."""
        pool = self.pool
        if not pool.store.shared:
            return False
        settling = pool.settle_later(lease, tokens)
        if settling is None:
            return False
        send_all = partial(_settled_together, pool, lease.key_id)
        carry.add_to(("lease", id(pool), lease.key_id), settling, send_all, record_id)
        return True


def _settled_together(
    pool: ProviderPool, key_id: str, leases: list[tuple[int, int, int]]
) -> Awaitable[None]:
    """The leases' settlement, sent now (with the round carrying it); the result awaits it."""
    return settled_quietly(pool.settle_together(key_id, leases))


async def settled_quietly(settling: Awaitable[object]) -> None:
    """Await a lease's settlement or release, logging a failure: the response is out, and a
    reservation lapses with its minute."""
    try:
        await settling
    except Exception as exc:
        log.warning("provider lease could not be settled: %r", exc)
