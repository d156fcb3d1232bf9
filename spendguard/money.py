"""Money is integer micro-USD everywhere inside spendguard; ``Decimal`` only at the edges."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import NewType

MicroUSD = NewType("MicroUSD", int)

MICROS_PER_USD = 1_000_000
_MICRO = Decimal("0.000001")


def usd_to_micros(value: Decimal | str | int) -> MicroUSD:
    """Convert a USD amount to micro-USD exactly; rejects amounts finer than one micro-USD."""
    try:
        amount = Decimal(value) if not isinstance(value, Decimal) else value
    except (InvalidOperation, ValueError) as exc:
        raise ValueError(f"not a USD amount: {value!r}") from exc
    if not amount.is_finite():
        raise ValueError(f"not a finite USD amount: {value!r}")
    micros = amount * MICROS_PER_USD
    if micros != micros.to_integral_value():
        raise ValueError(f"USD amount {value!r} is finer than one micro-USD")
    return MicroUSD(int(micros))


def micros_to_usd(micros: int) -> Decimal:
    """Exact Decimal USD for a micro-USD integer."""
    return (Decimal(micros) / MICROS_PER_USD).quantize(_MICRO)


def ceil_micros(amount: Decimal) -> MicroUSD:
    """Round a fractional micro-USD cost up: a budget errs towards the operator, not the caller."""
    return MicroUSD(int(amount.to_integral_value(rounding=ROUND_CEILING)))
