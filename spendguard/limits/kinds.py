"""Every kind of limit spendguard enforces, described in the one vocabulary (design.md, "The
limit model" and "Adding a limit kind").

A limit is a subject (:class:`SubjectKind`) x a window (a UTC calendar :class:`Period`, a
:class:`Rolling` window in slices, or the rate window of one sliding minute) x a unit
(:class:`Unit`) x a mode (:class:`Mode`: soft admits while below, hard reserves the worst
case) x whether settlement folds the ledger's aggregates into its counters (calendar spend
limits and balances) or not (rolling budgets, rates and provider capacity: counted in the
store alone, rebuilt from the records after a loss, or lapsing with their window).

:data:`KINDS` is the table the engine and the docs read: which part of the admission round
plans a kind, which Redis slot its script runs in, and what an outage of its store answers
(the one fail-mode rule: open or closed by the kind's setting, ``Retry-After`` its
``outage_retry_after``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from .model import Mode, SubjectKind, Unit


class WindowKind(StrEnum):
    CALENDAR = "calendar"  # a UTC day or month (Period): resets at 00:00 UTC / on the 1st
    ROLLING = "rolling"  # the last N seconds in 60 slices (Rolling): drains slice by slice
    RATE = "rate"  # one sliding minute (RPM, TPM) or none (in flight): limits/rates.py
    NONE = "none"  # never resets (a balance) or not counted (a model list)


class Part(StrEnum):
    """The part of the admission round that plans a kind and sends its script (engine/round.py)."""

    SPEND = "spend"  # SpendGuard: one script in the team's slot
    BUDGETS = "budgets"  # BudgetGate: one script per bucket's slot
    PROVIDERS = "providers"  # ProviderRouting: one script in the pool's slot


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    subjects: tuple[SubjectKind, ...]
    window: WindowKind
    units: tuple[Unit, ...]
    modes: tuple[Mode, ...]
    settled: bool  # settlement folds the ledger's aggregates into its counters
    part: Part
    slot: str  # the hash tag its keys share (one script, one slot)
    fail_setting: str  # what chooses open or closed when its store is down
    fail_open_by_default: bool
    outage_retry_after: int  # the Retry-After of its 503 when its store is down


_TEAM_OR_KEY = (SubjectKind.TEAM, SubjectKind.API_KEY)


def _team_slot(
    name: str,
    subjects: tuple[SubjectKind, ...],
    window: WindowKind,
    units: tuple[Unit, ...],
    modes: tuple[Mode, ...],
    settled: bool,
) -> Kind:
    """A kind the team's preflight decides: one script in the team's slot, one fail mode."""
    return Kind(
        name, subjects, window, units, modes, settled, Part.SPEND, "{<team>}",
        "SPENDGUARD_FAIL_MODE", fail_open_by_default=False, outage_retry_after=1,
    )  # fmt: skip


_USD, _BOTH = (Unit.USD,), (Mode.SOFT, Mode.HARD)

KINDS: Final = {
    kind.name: kind
    for kind in (
        _team_slot("spend_limit", _TEAM_OR_KEY, WindowKind.CALENDAR, _USD, _BOTH, True),
        _team_slot("balance", (SubjectKind.TEAM,), WindowKind.NONE, _USD, _BOTH, True),
        _team_slot(
            "rate",
            _TEAM_OR_KEY,
            WindowKind.RATE,
            (Unit.REQUESTS, Unit.TOKENS, Unit.IN_FLIGHT),
            (Mode.HARD,),
            False,
        ),
        _team_slot("model_access", _TEAM_OR_KEY, WindowKind.NONE, (), (), False),
        Kind(
            "budget",
            (
                SubjectKind.API_KEY,
                SubjectKind.END_USER,
                SubjectKind.TAG,
                SubjectKind.CUSTOMER,
                SubjectKind.MODEL,
                SubjectKind.FLEET,
            ),
            WindowKind.ROLLING,
            (Unit.TOKENS, Unit.USD, Unit.REQUESTS),
            (Mode.HARD,),
            False,
            Part.BUDGETS,
            "{<team>} (key, end user) | {pool} (model, fleet) | {bt:<tag>} | {bc:<customer>}",
            "budgets.fail_open",
            # As docs/budgets.md states them: a budget outage admits, counted per replica, and its
            # 503 (fail_open: false) asks for 5 s.
            fail_open_by_default=True,
            outage_retry_after=5,
        ),
        Kind(
            "provider_capacity",
            (SubjectKind.PROVIDER_KEY,),
            WindowKind.RATE,
            (Unit.REQUESTS, Unit.TOKENS),
            (Mode.HARD,),
            False,
            Part.PROVIDERS,
            "{pool}",
            "(always closed)",  # no key may be chosen blind: a pool whose store is down refuses
            fail_open_by_default=False,
            outage_retry_after=1,
        ),
    )
}
"""Every limit kind, by name."""
