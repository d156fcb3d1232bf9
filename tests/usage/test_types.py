"""Tests for spendguard.usage.types: the normalised values and the checks behind them."""

from __future__ import annotations

import pytest

from spendguard.asgi.routes import Dialect as RouteDialect
from spendguard.usage import Dialect, Usage, estimate_usage
from spendguard.usage.types import InvalidCount, token_count, valid_model


@pytest.mark.parametrize(("chars", "tokens"), [(0, 0), (1, 1), (4, 1), (5, 2), (400, 100)])
def test_estimate_usage_rounds_output_up(chars: int, tokens: int) -> None:
    assert estimate_usage(25, chars) == Usage(input_tokens=25, output_tokens=tokens, estimated=True)


def test_estimate_usage_never_goes_negative() -> None:
    assert estimate_usage(-3, -10) == Usage(estimated=True)


def test_one_dialect_type_equal_to_its_plain_strings() -> None:
    assert RouteDialect is Dialect
    assert Dialect.OPENAI == "openai"
    assert Dialect.ANTHROPIC == "anthropic"
    assert Dialect("anthropic") is Dialect.ANTHROPIC
    assert {Dialect.OPENAI: 1}.get("openai") == 1  # hashes like the string too


@pytest.mark.parametrize("value", [0, 1, 10**9])
def test_token_count_accepts_plausible_counts(value: int) -> None:
    assert token_count(value) == value


@pytest.mark.parametrize("value", ["12", -5, 12.0, True, 10**9 + 1, [], {}])
def test_token_count_refuses_anything_else(value: object) -> None:
    with pytest.raises(InvalidCount):
        token_count(value)


def test_an_absent_or_null_count_reads_as_zero() -> None:
    assert token_count(None) == 0


def test_valid_model() -> None:
    assert valid_model("gpt-4o-mini") == "gpt-4o-mini"
    for bad in ("", "   ", "x" * 257, "a\nb", 5, None):
        assert valid_model(bad) is None
    assert valid_model("x" * 256) == "x" * 256
