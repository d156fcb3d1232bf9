"""Money is integer micro-USD everywhere inside spendguard; ``Decimal`` only at the edges."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import NewType

MicroUSD = NewType("MicroUSD", int)

MICROS_PER_USD = 1_000_000
# The one bound on an amount an operator enters (a limit, a top-up): $1,000,000,000. Sums of
# such amounts stay far inside what every layer holds exactly: BIGINT columns (2^63), Redis
# hash integers (64-bit) and the store scripts' argument check (at most 18 decimal digits).
MAX_AMOUNT_MICROS = 1_000_000_000 * MICROS_PER_USD
# A team's top-ups together: 100 times the single bound, still 10x under the scripts' check.
MAX_TOTAL_MICROS = 100 * MAX_AMOUNT_MICROS
_MICRO = Decimal("0.000001")


def usd_to_micros(value: Decimal | str | int) -> MicroUSD:
    """Convert a USD amount to micro-USD exactly; rejects amounts finer than one micro-USD."""
    try:
        amount = Decimal(value) if not isinstance(value, Decimal) else value
    except (InvalidOperation, ValueError) as exc:
        raise ValueError(f"not a USD amount: {value!r}") from exc
    if not amount.is_finite():
        raise ValueError(f"not a finite USD amount: {value!r}")
    try:
        micros = amount * MICROS_PER_USD
        whole = micros.to_integral_value()
    except ArithmeticError as exc:  # beyond the decimal context's precision, e.g. 1e100
        raise ValueError(f"USD amount {value!r} is out of range") from exc
    if micros != whole:
        raise ValueError(f"USD amount {value!r} is finer than one micro-USD")
    return MicroUSD(int(micros))


def checked_amount(micros: int, what: str, *, allow_zero: bool) -> MicroUSD:
    """``micros`` if it is within the one bound (ValueError naming ``what`` otherwise)."""
    if micros < 0 or (micros == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'at least 0' if allow_zero else 'positive'} USD")
    if micros > MAX_AMOUNT_MICROS:
        raise ValueError(f"{what} must be at most {MAX_AMOUNT_MICROS // MICROS_PER_USD:,} USD")
    return MicroUSD(micros)


def micros_to_usd(micros: int) -> Decimal:
    """Exact Decimal USD for a micro-USD integer."""
    return (Decimal(micros) / MICROS_PER_USD).quantize(_MICRO)


def usd_text(micros: int | None) -> str | None:
    """Micro-USD as an exact decimal string (``"1.500000"``); None stays None."""
    return None if micros is None else str(micros_to_usd(micros))


def ceil_micros(amount: Decimal) -> MicroUSD:
    """Round a fractional micro-USD cost up: a budget errs towards the operator, not the caller."""
    return MicroUSD(int(amount.to_integral_value(rounding=ROUND_CEILING)))
