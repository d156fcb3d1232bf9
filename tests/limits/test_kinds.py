"""The table of limit kinds says what the code does: its fail-mode defaults are the settings'
and the budgets section's, its slots are the store's hash tags, and every subject kind and unit
of the vocabulary is used by some kind."""

from __future__ import annotations

from spendguard import Settings
from spendguard.budgets.config import BudgetsConfig
from spendguard.limits.kinds import KINDS, Part, WindowKind
from spendguard.limits.model import SubjectKind, Unit
from spendguard.settings import FailMode
from spendguard.store.redis import RedisStore
from spendguard.store.rolling import Bucket


def test_the_fail_mode_defaults_are_the_settings_defaults() -> None:
    spend_open = Settings().fail_mode is FailMode.OPEN
    for name in ("spend_limit", "balance", "rate", "model_access"):
        assert KINDS[name].fail_open_by_default is spend_open
    assert KINDS["budget"].fail_open_by_default is BudgetsConfig().fail_open
    assert KINDS["provider_capacity"].fail_open_by_default is False


def test_every_subject_kind_and_unit_belongs_to_some_kind() -> None:
    subjects = {s for kind in KINDS.values() for s in kind.subjects}
    units = {u for kind in KINDS.values() for u in kind.units}
    assert subjects == set(SubjectKind)
    assert units == set(Unit)


def test_only_calendar_spend_and_balances_are_settled() -> None:
    settled = {name for name, kind in KINDS.items() if kind.settled}
    assert settled == {"spend_limit", "balance"}
    assert all(KINDS[name].window in (WindowKind.CALENDAR, WindowKind.NONE) for name in settled)


TEAM_OWNED = (SubjectKind.API_KEY, SubjectKind.END_USER)


def test_the_slots_are_the_stores_hash_tags() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0", prefix="p")
    assert "{pool}" in store.pool_key("k") and KINDS["provider_capacity"].slot == "{pool}"
    for kind in SubjectKind:
        if kind in KINDS["budget"].subjects:
            bucket = Bucket(kind, "team:x" if kind in TEAM_OWNED else "x")
            slot = "{<team>}" if kind in TEAM_OWNED else "{" + bucket.slot.partition(":")[0]
            assert slot in KINDS["budget"].slot, (kind, slot)
    assert {k.part for k in KINDS.values()} == set(Part)
