"""Tests for spendguard.money: integer micro-USD inside, exact Decimal USD at the edges."""

from __future__ import annotations

from decimal import Decimal

import pytest

from spendguard.money import ceil_micros, micros_to_usd, usd_to_micros


def test_money_is_exact() -> None:
    assert usd_to_micros("5.00") == 5_000_000
    assert str(micros_to_usd(2**53 + 1)) == "9007199254.740993"
    with pytest.raises(ValueError):
        usd_to_micros("0.0000001")
    with pytest.raises(ValueError):
        usd_to_micros("NaN")


@pytest.mark.parametrize("bad", ["abc", "", "Infinity", "-inf", "1e-7"])
def test_anything_but_a_finite_whole_micro_amount_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        usd_to_micros(bad)


def test_round_trip_and_rounding_up() -> None:
    assert usd_to_micros(Decimal("0.000001")) == 1 and usd_to_micros(3) == 3_000_000
    assert micros_to_usd(usd_to_micros("12.345678")) == Decimal("12.345678")
    assert micros_to_usd(5) == Decimal("0.000005")
    # A fractional cost errs towards the operator: 0.1 micro-USD is charged as 1.
    assert ceil_micros(Decimal("0.1")) == 1 and ceil_micros(Decimal("7")) == 7
