"""Tests for spendguard.limits.model: subjects, limits, balances and the order they are checked."""

from __future__ import annotations

import pytest

from spendguard.identity import Identity
from spendguard.limits import (
    Balance,
    Limit,
    Period,
    Subject,
    SubjectKind,
    Unit,
    applicable,
    key_limit,
    limit_for,
    team_limit,
)

ALPHA = Identity("acme", "alpha")
TEAM_ONLY = Identity("acme")
TEAM, KEY = Subject("acme"), Subject("acme", "alpha")


def test_applicable_checks_narrowest_first_then_the_balance() -> None:
    # A key before its team, a day before its month, the balance last: a denial names the
    # most specific problem.
    assert applicable(ALPHA) == (
        Limit(KEY, Period.DAY),
        Limit(KEY, Period.MONTH),
        Limit(TEAM, Period.DAY),
        Limit(TEAM, Period.MONTH),
        Balance("acme"),
    )


def test_applicable_without_an_api_key_is_the_team_and_its_balance() -> None:
    assert applicable(TEAM_ONLY) == (
        Limit(TEAM, Period.DAY),
        Limit(TEAM, Period.MONTH),
        Balance("acme"),
    )


def test_applicable_uses_the_encoded_ids() -> None:
    odd = Identity("a:b", "k{1}")
    targets = applicable(odd)
    assert {t.team for t in targets} == {odd.team} and odd.team != "a:b"
    assert targets[0] == Limit(Subject(odd.team, odd.api_key), Period.DAY)


def test_a_team_subject_covers_every_key_and_a_key_subject_only_its_own() -> None:
    assert TEAM.covers("alpha") and TEAM.covers("beta") and TEAM.covers(None)
    assert KEY.covers("alpha")
    assert not KEY.covers("beta") and not KEY.covers(None)


def test_subject_kind_follows_the_api_key() -> None:
    assert TEAM.kind is SubjectKind.TEAM and KEY.kind is SubjectKind.API_KEY


def test_limit_constructors() -> None:
    assert team_limit(ALPHA, Period.MONTH) == Limit(TEAM, Period.MONTH)
    assert key_limit(ALPHA, Period.DAY) == Limit(KEY, Period.DAY)
    assert limit_for(ALPHA, Period.DAY) == Limit(KEY, Period.DAY)  # its key's own
    assert limit_for(TEAM_ONLY, Period.DAY) == Limit(TEAM, Period.DAY)  # else its team's
    with pytest.raises(ValueError, match="API key"):
        key_limit(TEAM_ONLY, Period.DAY)


def test_limits_are_values_in_micro_usd() -> None:
    limit = Limit(KEY, Period.DAY)
    assert limit.unit is Unit.USD and limit.team == "acme"
    assert limit == Limit(Subject("acme", "alpha"), Period.DAY)
    assert len({limit, Limit(KEY, Period.DAY), Limit(KEY, Period.MONTH)}) == 2
    assert Balance("acme") != Limit(TEAM, Period.DAY)
