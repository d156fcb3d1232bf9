"""Tests for spendguard.integrations.litellm: a LiteLLM ``model_list`` read into price-table
names, and the name each deployment is charged under; on a table of its own (the shipped
prices are not what is tested here), with model lists shaped as LiteLLM's router keeps them."""

from __future__ import annotations

import logging
import sys
from decimal import Decimal
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from spendguard.engine.pricing import Price, PriceTable
from spendguard.integrations.litellm import (
    RESYNC_SECONDS,
    LiteLLMRouting,
    litellm_routing,
    router_prices,
)
from spendguard.usage import Usage

MINI = Price.of("0.15", "0.60", "0.075")
FOUR_O = Price.of("2.50", "10", "1.25")
DEFAULT = Price.of("15", "75")
USAGE = Usage(input_tokens=1000, output_tokens=100, cached_input_tokens=200)


def table(**options: Any) -> PriceTable:
    prices = {"gpt-4o-mini": MINI, "gpt-4o": FOUR_O, "default": DEFAULT}
    return PriceTable(prices, as_of="2026-11-01", **options)


def deployment(
    name: str, model: str, ident: str, info: dict[str, Any] | None = None, **params: Any
) -> dict[str, Any]:
    """One ``model_list`` entry as LiteLLM's router holds it (its ``model_info`` has an id)."""
    return {
        "model_name": name,
        "litellm_params": {"model": model, "api_key": "sk-never-read", **params},
        "model_info": {"id": ident, "db_model": False, **(info or {})},
    }


def priced(base: PriceTable, model_list: list[dict[str, Any]]) -> tuple[PriceTable, Any]:
    built = router_prices(base, model_list)
    return base.with_aliases(built.aliases), built


def cost(t: PriceTable, name: str) -> int | None:
    found = t.cost(name, USAGE)
    return None if found is None else int(found)


def test_an_alias_is_priced_as_the_model_it_routes_to() -> None:
    t, built = priced(table(), [deployment("team-gpt", "openai/gpt-4o-mini", "d1")])
    found = t.match("team-gpt")
    assert found is not None and found.entry == "gpt-4o-mini" and found.price == MINI
    assert built.routed == {"d1": "gpt-4o-mini"}  # charged under the table's own name
    assert cost(t, "team-gpt") == cost(table(), "gpt-4o-mini")


def test_an_alias_with_its_own_prices_is_charged_them_exactly() -> None:
    info = {"input_cost_per_token": 1e-07, "output_cost_per_token": 4e-07}
    t, built = priced(table(), [deployment("team-cheap", "openai/gpt-4o-mini", "c1", info)])
    price = t.lookup("team-cheap")
    # Per-token floats to per-1M decimals with every digit kept; the cache price LiteLLM
    # inherits from the model behind it where the deployment names none.
    assert price == Price.of(Decimal("0.1"), Decimal("0.4"), Decimal("0.075"), Decimal("0.15"))
    assert built.routed == {"c1": "team-cheap"}
    # 1000 in at 0.1, 100 out at 0.4, 200 cache reads at 0.075 per 1M: 100 + 40 + 15 = 155
    assert cost(t, "team-cheap") == 155


def test_litellm_params_prices_come_before_model_info() -> None:
    info = {"input_cost_per_token": 9e-06, "output_cost_per_token": 9e-06}
    entry = deployment(
        "mine",
        "openai/my-model",
        "m1",
        info,
        input_cost_per_token="2e-7",
        output_cost_per_token=8e-07,
        cache_read_input_token_cost=1e-07,
    )
    t, _ = priced(table(), [entry])
    assert t.lookup("mine") == Price.of("0.2", "0.8", "0.1")  # no model behind: write = input


def test_several_deployments_are_held_at_the_dearest_and_charged_as_the_one_that_served() -> None:
    cheap = {"input_cost_per_token": 1e-07, "output_cost_per_token": 9e-07}
    model_list = [
        deployment("team-mixed", "openai/gpt-4o-mini", "list"),
        deployment("team-mixed", "azure/negotiated", "cheap", cheap),
    ]
    t, built = priced(table(), model_list)
    # Each price the dearest of the two (0.15 in from one, 0.90 out from the other): a hold
    # no deployment's charge exceeds.
    assert t.lookup("team-mixed") == Price.of("0.15", "0.9", "0.1", "0.15")
    assert built.routed == {"list": "gpt-4o-mini", "cheap": "team-mixed@cheap"}
    assert t.lookup("team-mixed@cheap") == Price.of("0.1", "0.9", "0.1", "0.1")
    assert t.lookup("gpt-4o-mini") == MINI  # the entry itself is untouched


def test_a_deployment_without_a_price_leaves_its_alias_to_the_unknown_model_rule() -> None:
    model_list = [
        deployment("team-odd", "openai/gpt-4o-mini", "a"),
        deployment("team-odd", "custom/unknown-thing", "b"),
    ]
    t, built = priced(table(), model_list)
    assert "team-odd" not in t and built.unpriced == ("team-odd",)
    assert built.routed == {"a": "gpt-4o-mini"}  # the priced one is still charged exactly


def test_base_model_prices_a_deployment_whose_model_the_table_does_not_know() -> None:
    entry = deployment("team-azure", "azure/my-deployment", "z", {"base_model": "azure/gpt-4o"})
    t, built = priced(table(), [entry])
    assert t.lookup("team-azure") == FOUR_O and built.routed == {"z": "gpt-4o"}


def test_the_operators_price_file_keeps_its_price_for_an_alias() -> None:
    own = Price.of("1", "2")
    base = PriceTable(
        {"gpt-4o-mini": MINI, "team-gpt": own, "default": DEFAULT},
        as_of="2026-11-01",
        from_file=["team-gpt"],
    )
    t, built = priced(base, [deployment("team-gpt", "openai/gpt-4o-mini", "d1")])
    assert t.lookup("team-gpt") == own
    assert built.routed == {"d1": "gpt-4o-mini"}  # what served it is still what is charged


def test_a_model_name_that_is_an_entry_and_routes_elsewhere_leaves_other_names_alone() -> None:
    model_list = [
        deployment("gpt-4o", "openai/gpt-4o-mini", "small"),  # this gateway's "gpt-4o" is mini
        deployment("big", "openai/gpt-4o", "large"),
    ]
    t, built = priced(table(), model_list)
    assert t.lookup("gpt-4o") == MINI and t.lookup("big") == FOUR_O
    assert built.routed == {"small": "gpt-4o-mini", "large": "big"}
    assert t.lookup(built.routed["large"]) == FOUR_O


def test_an_own_priced_model_name_that_is_an_entry_does_not_reprice_other_aliases() -> None:
    negotiated = {"input_cost_per_token": 1e-07, "output_cost_per_token": 5e-07}
    model_list = [
        deployment("gpt-4o-mini", "azure/mini", "neg", negotiated),
        deployment("team-gpt", "openai/gpt-4o-mini", "list"),
    ]
    t, built = priced(table(), model_list)
    assert t.lookup("team-gpt") == MINI  # the list price, not the negotiated one
    assert t.lookup("gpt-4o-mini") == Price.of("0.1", "0.5")  # no model behind: cache = input
    assert built.routed == {"neg": "gpt-4o-mini", "list": "team-gpt"}


def test_model_group_aliases_and_wildcards() -> None:
    model_list = [
        deployment("team-gpt", "openai/gpt-4o-mini", "d1"),
        deployment("openai/*", "openai/*", "wild"),  # serves what the client names
    ]
    built = router_prices(table(), model_list, {"gpt-legacy": {"model": "team-gpt"}})
    t = table().with_aliases(built.aliases)
    assert t.lookup("gpt-legacy") == MINI
    assert "openai/*" not in built.aliases and "wild" not in built.routed


def test_an_unusable_price_is_no_price(caplog: pytest.LogCaptureFixture) -> None:
    info = {"input_cost_per_token": -1e-07, "output_cost_per_token": 4e-07}
    with caplog.at_level(logging.WARNING, "spendguard"):
        built = router_prices(table(), [deployment("bad", "openai/gpt-4o-mini", "x", info)])
    assert built.unpriced == ("bad",) and built.routed == {}
    assert any("unusable price" in r.getMessage() for r in caplog.records)


# -- the running proxy ----------------------------------------------------------------------


def proxy_module(app: object, model_list: list[dict[str, Any]] | None) -> ModuleType:
    module = ModuleType("litellm.proxy.proxy_server")
    module.app = app  # type: ignore[attr-defined]
    module.llm_router = None if model_list is None else SimpleNamespace(model_list=model_list)  # type: ignore[attr-defined]
    return module


def test_only_litellms_app_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    app, other = object(), object()
    assert litellm_routing([app], table()) is None  # the module is not even loaded
    monkeypatch.setitem(sys.modules, "litellm.proxy.proxy_server", proxy_module(app, []))
    assert litellm_routing([other, None], table()) is None
    wrapper = SimpleNamespace(app=SimpleNamespace(app=app))  # middleware around it
    assert isinstance(litellm_routing([None, wrapper], table()), LiteLLMRouting)


def test_the_router_is_read_again_when_its_model_list_changes() -> None:
    model_list = [deployment("team-gpt", "openai/gpt-4o-mini", "d1")]
    routing = LiteLLMRouting(proxy_module(object(), model_list), table())
    first = routing.prices(now=100.0)
    assert first is not None and first.lookup("team-gpt") == MINI
    assert routing.prices(now=100.0 + RESYNC_SECONDS) is None  # unchanged: no new table
    header = [(b"x-litellm-model-id", b"d2")]
    model_list.append(deployment("team-big", "openai/gpt-4o", "d2"))
    assert routing.routed(header) is None  # not read yet: the next read comes sooner
    assert routing.prices(now=100.0 + RESYNC_SECONDS + 0.5) is None  # not due yet
    again = routing.prices(now=100.0 + RESYNC_SECONDS + 1.0)
    assert again is not None and again.lookup("team-big") == FOUR_O
    assert routing.routed([(b"X-LiteLLM-Model-Id", b"d2")]) == "gpt-4o"
    assert routing.routed([(b"content-type", b"application/json")]) is None


def test_no_router_yet_is_no_table() -> None:
    routing = LiteLLMRouting(proxy_module(object(), None), table())
    assert routing.prices(now=1.0) is None
