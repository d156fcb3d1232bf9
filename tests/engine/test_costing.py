"""The unknown-model rule (spendguard.engine.costing): a model charged the default price is
warned about once per name and counted, by stage, without its name in any label."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from spendguard.engine.costing import Coster, Stage
from spendguard.engine.pricing import Price, PriceTable
from spendguard.settings import UnknownModel
from spendguard.usage import Usage

TABLE = PriceTable(
    {"known": Price.of("1", "1"), "default": Price.of("15", "75")}, as_of="2026-01-01"
)
USAGE = Usage(input_tokens=10, output_tokens=2)


def counted(stage: str) -> float:
    return REGISTRY.get_sample_value("spendguard_default_priced_total", {"stage": stage}) or 0.0


def test_a_default_priced_model_is_warned_once_and_counted_by_stage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    coster = Coster(TABLE, UnknownModel.DEFAULT_PRICE)
    estimates, settlements = counted("estimate"), counted("settlement")
    with caplog.at_level(logging.WARNING, logger="spendguard"):
        assert coster.cost("mystery-1", USAGE) == 10 * 15 + 2 * 75
        assert coster.cost("mystery-1", USAGE) == 300
        assert coster.cost("mystery-1", USAGE, stage=Stage.SETTLEMENT) == 300
        assert coster.cost("mystery-2", USAGE) == 300
        assert coster.cost("known", USAGE) == 12  # priced: neither warned nor counted
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "'mystery-1'" in warnings[0] and "'mystery-2'" in warnings[1]
    assert "default price" in warnings[0]
    assert counted("estimate") - estimates == 3
    assert counted("settlement") - settlements == 1


def test_the_counter_has_only_the_stage_label() -> None:
    Coster(TABLE, UnknownModel.DEFAULT_PRICE).cost("a-model-name", USAGE)
    labels = {
        tuple(sorted(sample.labels))
        for metric in REGISTRY.collect()
        if metric.name == "spendguard_default_priced"
        for sample in metric.samples
    }
    assert labels == {("stage",)}


def unknown(rule: UnknownModel, stage: str) -> float:
    sample = REGISTRY.get_sample_value(
        "spendguard_unknown_model_total", {"rule": rule.value, "stage": stage}
    )
    return sample or 0.0


@pytest.mark.parametrize("rule", [UnknownModel.FREE, UnknownModel.REJECT])
def test_other_rules_charge_nothing_but_warn_once_and_count_the_unknown_model(
    rule: UnknownModel, caplog: pytest.LogCaptureFixture
) -> None:
    before, unknown_before = counted("estimate"), unknown(rule, "estimate")
    coster = Coster(TABLE, rule)
    with caplog.at_level(logging.WARNING, logger="spendguard"):
        assert coster.cost("mystery", USAGE) == 0
        assert coster.cost("mystery", USAGE) == 0
        assert coster.price("mystery") is None
    assert counted("estimate") == before  # no default price was charged
    assert unknown(rule, "estimate") - unknown_before == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'mystery'" in warnings[0]
    assert ("refused" if rule is UnknownModel.REJECT else "charged nothing") in warnings[0]


def test_every_rule_counts_unknown_models_by_rule_and_stage() -> None:
    coster = Coster(TABLE, UnknownModel.DEFAULT_PRICE)
    before = unknown(UnknownModel.DEFAULT_PRICE, "settlement")
    assert coster.price("mystery-s", stage=Stage.SETTLEMENT) == TABLE.lookup("default")
    assert unknown(UnknownModel.DEFAULT_PRICE, "settlement") - before == 1
    refusals = unknown(UnknownModel.REJECT, "admission")
    Coster(TABLE, UnknownModel.REJECT).refused("mystery-r")
    assert unknown(UnknownModel.REJECT, "admission") - refusals == 1
    assert coster.price("known") == Price.of("1", "1")
