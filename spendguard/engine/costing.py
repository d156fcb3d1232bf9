"""What an inference costs: the price table plus the configured rule for unpriced models."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Final

from ..errors import ConfigurationError
from ..metrics import DEFAULT_PRICED, UNKNOWN_MODEL
from ..settings import UnknownModel
from ..usage import Usage
from .pricing import Price, PriceTable

log = logging.getLogger("spendguard")

DEFAULT_ENTRY = "default"
# Model names are the client's: past this many, the warning stops naming new ones (the
# counter still counts), so a client sending random names can't grow memory or flood logs.
_WARNED_MAX: Final = 1000


class Stage(StrEnum):
    """Which cost a price serves (the label of the default-price counter)."""

    ESTIMATE = "estimate"  # postflight's estimate (and a dead gateway's recovered one)
    SETTLEMENT = "settlement"  # the exact charge written to the ledger
    HOLD = "hold"  # preflight's worst case, held on hard limits: not a charge
    ADMISSION = "admission"  # refused before the provider (unknown_model=reject)


class Coster:
    """``cost()`` is used for the postflight estimate and for the exact settlement charge, so
    the two agree whenever the provider reported usage.

    A model the table does not price is logged once per model name (a warning, whatever the
    unknown-model rule) and counted in ``spendguard_unknown_model_total`` (and, charged the
    deliberately dear ``default`` entry, in ``spendguard_default_priced_total``).
    """

    __slots__ = ("_fallback", "_table", "_unknown", "_warned")

    def __init__(self, table: PriceTable, unknown: UnknownModel) -> None:
        self._table = table
        self._unknown = unknown
        self._fallback: Price | None = None
        self._warned: set[str] = set()
        if unknown is UnknownModel.DEFAULT_PRICE:
            self._fallback = table.lookup(DEFAULT_ENTRY)
            if self._fallback is None:
                raise ConfigurationError(
                    "unknown_model=default_price needs a 'default' entry in the price table"
                )

    def use(self, table: PriceTable) -> None:
        """Price from ``table`` from now on (a gateway's own model names, read after start).
        The settlement worker and recovery share this coster, so they price alike; the swap
        is two plain assignments, done after every check, so no caller sees half of it."""
        fallback = self._fallback
        if self._unknown is UnknownModel.DEFAULT_PRICE:
            fallback = table.lookup(DEFAULT_ENTRY)
            if fallback is None:
                raise ConfigurationError(
                    "unknown_model=default_price needs a 'default' entry in the price table"
                )
        self._table, self._fallback = table, fallback

    @property
    def rejects_unknown(self) -> bool:
        return self._unknown is UnknownModel.REJECT

    @property
    def table(self) -> PriceTable:
        return self._table

    def is_priced(self, model: str) -> bool:
        return self._table.lookup(model) is not None

    def price(self, model: str, *, stage: Stage = Stage.ESTIMATE) -> Price | None:
        """The price ``model`` is charged at: its table entry, else the unknown-model rule's
        (the ``default`` entry, or None: charged nothing). An unknown model is logged once
        and counted every time."""
        price = self._table.lookup(model)
        if price is not None:
            return price
        self._unpriced(model, stage)
        return self._fallback

    def cost(self, model: str, usage: Usage, *, stage: Stage = Stage.ESTIMATE) -> int:
        price = self.price(model, stage=stage)
        # REJECT keeps unpriced models from reaching the provider; one that slips through (a
        # price file edited between request and settlement) is charged nothing, not guessed.
        return 0 if price is None else int(price.cost(usage))

    def refused(self, model: str) -> None:
        """An unknown model refused at admission (unknown_model=reject): logged and counted."""
        self._unpriced(model, Stage.ADMISSION)

    def _unpriced(self, model: str, stage: Stage) -> None:
        rule = self._unknown
        UNKNOWN_MODEL.labels(rule.value, stage.value).inc()
        if rule is UnknownModel.DEFAULT_PRICE:
            DEFAULT_PRICED.labels(stage.value).inc()
        if model in self._warned or len(self._warned) >= _WARNED_MAX:
            return
        self._warned.add(model)
        if rule is UnknownModel.DEFAULT_PRICE:
            fallback = self._fallback
            what = (
                f"charged the default price ({fallback.input if fallback else '?'} in, "
                f"{fallback.output if fallback else '?'} out per 1M tokens)"
            )
        elif rule is UnknownModel.REJECT:
            what = "refused with a 400"
        else:
            what = "charged nothing (unknown_model=free)"
        log.warning(
            "model %r is not in the price table: %s; add it to a price file "
            "(SPENDGUARD_PRICES) or check `spendguard prices show %s`",
            model,
            what,
            model,
        )
