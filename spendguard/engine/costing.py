"""What an inference costs: the price table plus the configured rule for unpriced models."""

from __future__ import annotations

from ..errors import ConfigurationError
from ..settings import UnknownModel
from ..usage import Usage
from .pricing import Price, PriceTable

DEFAULT_ENTRY = "default"


class Coster:
    """``cost()`` is used for the postflight estimate and for the exact settlement charge, so
    the two agree whenever the provider reported usage."""

    __slots__ = ("_fallback", "_table", "_unknown")

    def __init__(self, table: PriceTable, unknown: UnknownModel) -> None:
        self._table = table
        self._unknown = unknown
        self._fallback: Price | None = None
        if unknown is UnknownModel.DEFAULT_PRICE:
            self._fallback = table.lookup(DEFAULT_ENTRY)
            if self._fallback is None:
                raise ConfigurationError(
                    "unknown_model=default_price needs a 'default' entry in the price table"
                )

    @property
    def rejects_unknown(self) -> bool:
        return self._unknown is UnknownModel.REJECT

    def is_priced(self, model: str) -> bool:
        return self._table.lookup(model) is not None

    def cost(self, model: str, usage: Usage) -> int:
        price = self._table.lookup(model) or self._fallback
        # REJECT keeps unpriced models from reaching the provider; one that slips through (a
        # price file edited between request and settlement) is charged nothing, not guessed.
        return 0 if price is None else int(price.cost(usage))
