"""Tests for spendguard.limits.codec: the one place limits become cache keys and fields."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from spendguard.identity import Identity
from spendguard.limits import (
    Balance,
    KeyCodec,
    Limit,
    Period,
    Policy,
    Subject,
    Target,
    applicable,
    key_limit,
    team_limit,
    window_of,
)
from spendguard.limits.codec import BALANCE_FIELD, LOADED_FIELD, field_of, parse_field

GRACE = timedelta(days=2)
CODEC = KeyCodec("quota", GRACE)
T0 = datetime(2026, 9, 30, 12, tzinfo=UTC)
ALPHA = Identity("acme", "alpha")
KEY_DAY, KEY_MONTH = key_limit(ALPHA, Period.DAY), key_limit(ALPHA, Period.MONTH)
TEAM_DAY, TEAM_MONTH = team_limit(ALPHA, Period.DAY), team_limit(ALPHA, Period.MONTH)
HOSTILE = ["a:b", "a{b}", "}{", "a b", "a\nb", "é", "x" * 500, "%7B", "~"]


def test_key_layout() -> None:
    assert CODEC.policy_key("acme") == "quota:{acme}:spend:policy"
    assert CODEC.balance_key("acme") == "quota:{acme}:spend:balance"
    assert CODEC.usage_key(TEAM_MONTH, "202609") == "quota:{acme}:spend:usage:team:month:202609"
    assert CODEC.usage_key(TEAM_DAY, "20260930") == "quota:{acme}:spend:usage:team:day:20260930"
    assert (
        CODEC.usage_key(KEY_DAY, "20260930")
        == "quota:{acme}:spend:usage:api_key:alpha:day:20260930"
    )
    assert (
        CODEC.usage_key(KEY_MONTH, "202609")
        == "quota:{acme}:spend:usage:api_key:alpha:month:202609"
    )
    assert CODEC.usage_key(Balance("acme"), "") == CODEC.balance_key("acme")
    assert KeyCodec("other", GRACE).policy_key("acme") == "other:{acme}:spend:policy"


@pytest.mark.parametrize("raw", ["acme", *HOSTILE])
def test_every_key_of_a_plan_carries_the_team_hash_tag_once(raw: str) -> None:
    ident = Identity(raw, raw)
    plan = CODEC.plan(ident, T0)
    keys = [plan.policy_key, *(c.usage_key for c in plan.checks)]
    for key in keys:
        # Exactly one {...}, and it is the encoded team: Redis Cluster hashes only that part,
        # so every key of one request lands in the team's slot.
        assert re.findall(r"\{([^}]*)\}", key) == [ident.team], key
        assert key.count("{") == key.count("}") == 1
        assert not set(key) & set(" \n\r\t")
    assert len(set(keys)) == len(keys)


def test_plan_checks_every_applicable_target_in_order() -> None:
    plan = CODEC.plan(ALPHA, T0)
    assert plan.team == "acme" and plan.policy_key == CODEC.policy_key("acme")
    assert [c.target for c in plan.checks] == list(applicable(ALPHA))
    assert [c.bucket for c in plan.checks] == ["20260930", "202609", "20260930", "202609", ""]
    assert [c.field for c in plan.checks] == [
        "api_key:alpha:day",
        "api_key:alpha:month",
        "team:day",
        "team:month",
        BALANCE_FIELD,
    ]


def test_a_check_expires_a_grace_after_its_window() -> None:
    day, month = CODEC.check(KEY_DAY, T0), CODEC.check(TEAM_MONTH, T0)
    assert day.expires_at == datetime(2026, 10, 1, tzinfo=UTC) + GRACE
    assert month.expires_at == datetime(2026, 10, 1, tzinfo=UTC) + GRACE
    assert CODEC.check(TEAM_MONTH, datetime(2026, 12, 31, tzinfo=UTC)).expires_at == (
        datetime(2027, 1, 1, tzinfo=UTC) + GRACE
    )
    # No window: reloaded now and then instead, at the latest a grace after t0's UTC day ends.
    balance = CODEC.check(Balance("acme"), T0)
    assert (balance.bucket, balance.expires_at) == ("", datetime(2026, 10, 1, tzinfo=UTC) + GRACE)
    assert balance.usage_key == CODEC.balance_key("acme")


def test_a_plan_is_built_once_per_utc_day_and_identity() -> None:
    codec = KeyCodec("q", GRACE)
    morning = codec.plan(ALPHA, datetime(2026, 9, 30, 0, 0, tzinfo=UTC))
    # The same day: the very same plan, nothing rebuilt.
    assert codec.plan(ALPHA, datetime(2026, 9, 30, 23, 59, 59, 999999, tzinfo=UTC)) is morning
    # Midnight: every day bucket moves on, the month's stays; the month's end moves the month.
    after = codec.plan(ALPHA, datetime(2026, 10, 1, tzinfo=UTC))
    assert after is not morning
    assert [c.bucket for c in after.checks] == ["20261001", "202610", "20261001", "202610", ""]
    assert [c.bucket for c in morning.checks] == ["20260930", "202609", "20260930", "202609", ""]
    # A retry that keeps yesterday's t0 gets yesterday's keys, not the cached day's.
    again = codec.plan(ALPHA, datetime(2026, 9, 30, 12, tzinfo=UTC))
    assert again == morning
    assert (
        codec.plan(Identity("acme", "beta"), T0)
        .checks[0]
        .usage_key.endswith(":api_key:beta:day:20260930")
    )


def test_key_plan_find() -> None:
    plan = CODEC.plan(ALPHA, T0)
    assert plan.find(TEAM_MONTH) is plan.checks[3]
    assert plan.find(Balance("acme")).field == BALANCE_FIELD
    with pytest.raises(KeyError):
        plan.find(Limit(Subject("acme", "beta"), Period.DAY))  # another key's limit
    with pytest.raises(KeyError):
        CODEC.plan(Identity("acme"), T0).find(KEY_DAY)  # no key: no key limit applies


def every_target(team: str, key: str) -> list[Target]:
    return [
        Balance(team),
        *(Limit(Subject(team), w) for w in Period),
        *(Limit(Subject(team, key), w) for w in Period),
    ]


@pytest.mark.parametrize("raw", ["acme", *HOSTILE])
def test_field_of_and_parse_field_round_trip_every_target_kind(raw: str) -> None:
    ident = Identity(raw, raw)
    assert ident.api_key is not None
    targets = every_target(ident.team, ident.api_key)
    fields = [field_of(t) for t in targets]
    assert len(set(fields)) == len(targets)
    for target, field in zip(targets, fields, strict=True):
        assert parse_field(ident.team, field) == target


@pytest.mark.parametrize(
    "junk",
    [
        LOADED_FIELD,
        "",
        "team",
        "team:",
        "team:week",
        "team:day:x",
        "api_key",
        "api_key:alpha",
        "api_key::day",
        "api_key:alpha:year",
        "api_key:alpha:day:x",
        "balance:x",
        "model:gpt-4o:day",
        "TEAM:day",
    ],
)
def test_junk_fields_parse_to_none(junk: str) -> None:
    assert parse_field("acme", junk) is None


def test_window_of_decodes_names_and_refuses_others() -> None:
    assert window_of("day") is Period.DAY and window_of("month") is Period.MONTH
    for bad in ("week", "DAY", "", "days"):
        with pytest.raises(ValueError):
            window_of(bad)


def test_policy_fields_is_the_teams_whole_hash() -> None:
    policies = [Policy(KEY_DAY, 5, "acme", "alpha"), Policy(TEAM_MONTH, 9, "acme")]
    assert KeyCodec.policy_fields(policies, balance=False) == {
        "api_key:alpha:day": 5,
        "team:month": 9,
    }
    assert KeyCodec.policy_fields([], balance=True) == {BALANCE_FIELD: 1}
    assert KeyCodec.policy_fields([], balance=False) == {}  # "no policy", cached as such


@pytest.mark.parametrize(
    "t0",
    [
        T0,
        datetime(2026, 9, 30, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(2026, 10, 1, tzinfo=UTC),
        datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC),
    ],
)
def test_a_reused_plan_equals_one_built_from_scratch(t0: datetime) -> None:
    # A plan reuses its identity's fields and key stems: across days, months and years it must
    # still equal the checks built one by one for that t0.
    codec = KeyCodec("quota", GRACE)
    for identity in (ALPHA, Identity("acme"), Identity("a:b", "k{1}")):
        codec.plan(identity, T0)  # remembered at another time
        fresh = tuple(codec.check(target, t0) for target in applicable(identity))
        assert codec.plan(identity, t0).checks == fresh


def test_remembered_identities_are_bounded() -> None:
    codec = KeyCodec("quota", GRACE)
    bound = KeyCodec.MAX_CACHED_IDENTITIES
    for n in range(bound + 5):
        plan = codec.plan(Identity(f"team{n}", "k"), T0)
        assert plan.policy_key == f"quota:{{team{n}}}:spend:policy"
    assert 0 < codec.remembered <= bound
