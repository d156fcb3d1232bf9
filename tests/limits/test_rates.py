"""The rate rule and what is derived from a scope's counters (limits/rates.py)."""

from __future__ import annotations

import pytest

from spendguard.limits.model import SubjectKind
from spendguard.limits.rates import (
    WINDOW_MS,
    RateDenial,
    RateKind,
    Rates,
    RateState,
    exceeds,
    minute_of,
    parse_state,
)


def state(prev: int, cur: int, elapsed_ms: int, rpm: int = 10) -> RateState:
    return RateState(
        SubjectKind.API_KEY, Rates(rpm=rpm), prev, cur, 0, 0, 0, 7 * WINDOW_MS + elapsed_ms
    )


def test_rates_encode_decode_and_bounds() -> None:
    assert Rates.decode(Rates(60, None, 4).encode()) == Rates(60, None, 4)
    assert Rates().empty and Rates().encode() == "0 0 0"
    for bad in (0, -1, 10**12 + 1, True):
        with pytest.raises(ValueError):
            Rates(rpm=bad)


def test_the_previous_minute_fades_linearly() -> None:
    assert minute_of(7 * WINDOW_MS + 15_050) == (7, 450)  # 100 ms ticks
    # 10 last minute, 15 s into this one: 10 * 0.75 = 7.5 count, so 2 more fit, not 3.
    assert not exceeds(10, 0, 2, 10, 450)
    assert exceeds(10, 0, 3, 10, 450)
    assert state(10, 0, 15_000).remaining(RateKind.RPM) == 2


@pytest.mark.parametrize(
    ("prev", "cur", "elapsed", "wait"),
    [
        (0, 0, 0, 0),  # empty: now
        (10, 0, 0, 6_000),  # 10 * (1 - e/60) + 1 <= 10 from e = 6 s
        (4, 5, 30_000, 0),  # 2 + 5 + 1 <= 10 already
        (10, 5, 30_000, 6_000),  # 5 + 5 + 1 > 10 until 10 fade to 4, at 36 s
        (0, 10, 30_000, 30_000 + 6_000),  # this minute is full: the next, once 10 fade to 9
    ],
)
def test_wait_until_a_request_fits(prev: int, cur: int, elapsed: int, wait: int) -> None:
    s = state(prev, cur, elapsed)
    assert s.wait_ms(RateKind.RPM, 1) == wait
    if wait:  # at that moment it fits, a millisecond before it does not
        minute, weight = minute_of(s.now_ms + wait)
        p, c = (prev, cur) if minute == 7 else (cur, 0)
        assert not exceeds(p, c, 1, 10, weight)
        minute, weight = minute_of(s.now_ms + wait - 1)
        p, c = (prev, cur) if minute == 7 else (cur, 0)
        assert exceeds(p, c, 1, 10, weight)


def test_reset_and_retry_after() -> None:
    assert state(0, 3, 10_000).reset_ms(RateKind.RPM) == 50_000 + WINDOW_MS
    assert state(3, 0, 10_000).reset_ms(RateKind.RPM) == 50_000
    assert state(0, 0, 10_000).reset_ms(RateKind.RPM) == 0
    assert RateDenial(state(10, 0, 0), RateKind.RPM, 1).retry_after() == 6
    assert RateDenial(state(0, 0, 0), RateKind.TPM, 11).retry_after() is None  # too large
    assert RateDenial(state(0, 0, 0), RateKind.PARALLEL, 1).retry_after() == 1


def test_script_state_round_trips() -> None:
    s = RateState(SubjectKind.TEAM, Rates(5, 100, 2), 1, 2, 30, 40, 1, 123)
    assert parse_state(SubjectKind.TEAM, s.encode(), 123) == s
