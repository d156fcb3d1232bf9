"""Where prices come from: LiteLLM's file as a first-class source (its provider-prefixed entries
answer bare names, by a stated rule), the installed package's file, the shipped table made from
it, and how close the shipped table stays to LiteLLM's own prices."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from spendguard.cli import main
from spendguard.engine.price_files import LITELLM, litellm_file
from spendguard.engine.price_refresh import shipped_document
from spendguard.engine.pricing import Price, PriceTable, Resolution

# LiteLLM's shape: per-token USD numbers, provider-prefixed keys.
FILE: dict[str, Any] = {
    "sample_spec": {"mode": "one of: chat, embedding", "litellm_provider": "x"},
    # Only a prefixed entry: the bare name is priced by it.
    "xai/grok-9": {
        "input_cost_per_token": 1.25e-06,
        "output_cost_per_token": 2.5e-06,
        "cache_read_input_token_cost": 2e-07,
        "input_cost_per_token_above_200k_tokens": 2.5e-06,
        "output_cost_per_token_above_200k_tokens": 5e-06,
        "litellm_provider": "xai",
        "max_output_tokens": 1000000,
        "mode": "chat",
    },
    # The maker's entry and a cloud's, priced differently: the maker's answers the bare name.
    "mistral/mistral-huge-latest": {
        "input_cost_per_token": 5e-07,
        "output_cost_per_token": 1.5e-06,
        "litellm_provider": "mistral",
        "mode": "chat",
    },
    "azure_ai/mistral-huge-latest": {
        "input_cost_per_token": 2e-06,
        "output_cost_per_token": 6e-06,
        "litellm_provider": "azure_ai",
        "mode": "chat",
    },
    # Two hosts and no maker, priced differently: ambiguous, priced by neither.
    "hostone/open-model-7b": {
        "input_cost_per_token": 1e-07,
        "output_cost_per_token": 1e-07,
        "litellm_provider": "hostone",
        "mode": "chat",
    },
    "hosttwo/open-model-7b": {
        "input_cost_per_token": 3e-07,
        "output_cost_per_token": 3e-07,
        "litellm_provider": "hosttwo",
        "mode": "chat",
    },
    # Two hosts agreeing: not ambiguous.
    "hostone/open-model-1b": {
        "input_cost_per_token": 5e-08,
        "output_cost_per_token": 5e-08,
        "litellm_provider": "hostone",
        "mode": "chat",
    },
    "hosttwo/open-model-1b": {
        "input_cost_per_token": 5e-08,
        "output_cost_per_token": 5e-08,
        "litellm_provider": "hosttwo",
        "mode": "chat",
    },
    # An entry of the bare name itself beats every prefixed one.
    "gemini-9-flash": {
        "input_cost_per_token": 3e-07,
        "output_cost_per_token": 2.5e-06,
        "litellm_provider": "vertex_ai-language-models",
        "mode": "chat",
    },
    "gemini/gemini-9-flash": {
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "gemini",
        "mode": "chat",
    },
    # Snapshots of one family priced alike, and of another priced apart.
    "claude-opus-9-20260101": {
        "input_cost_per_token": 5e-06,
        "output_cost_per_token": 2.5e-05,
        "litellm_provider": "anthropic",
        "mode": "chat",
    },
    "claude-opus-9-20260601": {
        "input_cost_per_token": 5e-06,
        "output_cost_per_token": 2.5e-05,
        "litellm_provider": "anthropic",
        "mode": "chat",
    },
    "gpt-9-2026-01-01": {
        "input_cost_per_token": 1e-06,
        "output_cost_per_token": 4e-06,
        "litellm_provider": "openai",
        "mode": "chat",
    },
    "gpt-9-2026-06-01": {
        "input_cost_per_token": 2e-06,
        "output_cost_per_token": 8e-06,
        "litellm_provider": "openai",
        "mode": "chat",
    },
    "dall-e-9": {"litellm_provider": "openai", "mode": "image_generation"},
}


def per_million(value: float) -> Decimal:
    """LiteLLM's per-token float as the exact per-1M decimal it was written as."""
    return Decimal(repr(value)) * 1_000_000


@pytest.fixture
def litellm_path(tmp_path: Path) -> Path:
    path = tmp_path / "model_prices_and_context_window.json"
    path.write_text(json.dumps(FILE), encoding="utf-8")
    return path


def test_a_prefixed_entry_answers_its_bare_name_with_its_tiers(litellm_path: Path) -> None:
    table = PriceTable.load(litellm_path)
    match = table.match("grok-9")
    assert match is not None and match.entry == "xai/grok-9" and match.from_file
    assert match.how is Resolution.ALIAS and match.max_output_tokens == 1_000_000
    entry = FILE["xai/grok-9"]
    assert match.price.input == per_million(entry["input_cost_per_token"])
    assert match.price.cached_input == per_million(entry["cache_read_input_token_cost"])
    (tier,) = match.price.tiers
    assert tier.above == 200_000
    assert tier.price.input == per_million(entry["input_cost_per_token_above_200k_tokens"])
    assert tier.price.output == per_million(entry["output_cost_per_token_above_200k_tokens"])


def test_the_makers_entry_answers_a_bare_name_before_a_clouds(litellm_path: Path) -> None:
    table = PriceTable.load(litellm_path)
    price = table.lookup("mistral-huge-latest")
    assert price == Price.of(per_million(5e-07), per_million(1.5e-06))
    # The cloud's own name keeps the cloud's price.
    assert table.lookup("azure_ai/mistral-huge-latest") == Price.of(
        per_million(2e-06), per_million(6e-06)
    )


def test_hosts_that_disagree_make_a_bare_name_ambiguous(litellm_path: Path) -> None:
    table = PriceTable.load(litellm_path)
    assert table.lookup("open-model-7b") is None
    assert table.ambiguous("open-model-7b") == ("hostone/open-model-7b", "hosttwo/open-model-7b")
    assert table.lookup("hostone/open-model-7b") == Price.of(per_million(1e-07), per_million(1e-07))
    assert table.lookup("open-model-1b") == Price.of(per_million(5e-08), per_million(5e-08))


def test_an_entry_of_the_bare_name_beats_the_prefixed_one(litellm_path: Path) -> None:
    table = PriceTable.load(litellm_path)
    assert table.lookup("gemini-9-flash") == Price.of(per_million(3e-07), per_million(2.5e-06))
    assert table.lookup("gemini/gemini-9-flash") == Price.of(0, 0)


def test_a_litellm_file_prices_bare_names_the_shipped_table_has_too(tmp_path: Path) -> None:
    # A bare name the shipped table prices is priced by the file's prefixed entry once the
    # file is laid over it: the operator's file is the newer truth.
    shipped = PriceTable.load()
    assert shipped.lookup("grok-4.3") is not None
    path = tmp_path / "litellm.json"
    path.write_text(
        json.dumps(
            {
                "xai/grok-4.3": {
                    "input_cost_per_token": 9e-06,
                    "output_cost_per_token": 9e-06,
                    "litellm_provider": "xai",
                    "mode": "chat",
                }
            }
        )
    )
    table = PriceTable.load(path)
    assert table.lookup("grok-4.3") == Price.of("9", "9")
    match = table.match("grok-4.3")
    assert match is not None and match.from_file


def test_prices_litellm_reads_the_installed_packages_file() -> None:
    path = litellm_file()
    assert path.name == "model_prices_and_context_window_backup.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    table = PriceTable.load(LITELLM)
    entry = data["gpt-4o-mini"]
    match = table.match("gpt-4o-mini")
    assert match is not None and match.from_file
    assert match.price.input == per_million(entry["input_cost_per_token"])
    assert match.price.output == per_million(entry["output_cost_per_token"])


# --------------------------------------------------------------------------- the comparison

MAKERS = ("openai", "anthropic", "gemini", "mistral", "deepseek", "xai")
# LiteLLM's own entries of bare Gemini names are Vertex AI's (where LiteLLM routes a bare
# gemini-* name); they are Google's too.
GOOGLE_BARE = "vertex_ai-language-models"


def litellm_chat_models(data: Mapping[str, Any]) -> dict[str, tuple[Decimal, Decimal, Decimal]]:
    """Independently of spendguard's rules: the first-party chat models of the six providers
    by bare name, with LiteLLM's input, output and cached-input prices per 1M tokens (a bare
    key's own entry first, as LiteLLM itself looks a bare name up)."""
    models: dict[str, tuple[Decimal, Decimal, Decimal]] = {}
    own: set[str] = set()
    for key, entry in data.items():
        if not isinstance(entry, dict):
            continue
        provider = entry.get("litellm_provider")
        if provider not in MAKERS and not (provider == GOOGLE_BARE and "/" not in key):
            continue
        if entry.get("mode") != "chat" or entry.get("input_cost_per_token") is None:
            continue
        head, _, rest = key.partition("/")
        bare = (rest if rest and head == provider else key).lower()
        if bare in own:
            continue
        inp = per_million(entry["input_cost_per_token"])
        out = per_million(entry.get("output_cost_per_token") or 0)
        cached = entry.get("cache_read_input_token_cost")
        models[bare] = (inp, out, inp if cached is None else per_million(cached))
        if "/" not in key:
            own.add(bare)
    return models


def within(got: Price, want: tuple[Decimal, Decimal, Decimal]) -> bool:
    return all(
        abs(g - w) <= w / 100
        for g, w in zip((got.input, got.output, got.cached_input), want, strict=True)
    )


def test_the_shipped_table_and_litellms_file_price_the_chat_models_as_litellm_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = json.loads(litellm_file().read_text(encoding="utf-8"))
    models = litellm_chat_models(data)
    assert len(models) > 150
    caplog.set_level(logging.INFO, logger="spendguard")
    for label, table, floor in [
        ("shipped", PriceTable.load(), 0.90),
        ("litellm", PriceTable.load(LITELLM), 0.98),
    ]:
        caplog.clear()
        matched, different, unknown = [], [], []
        for name, want in models.items():
            found = table.match(name)
            if found is None:
                unknown.append(name)
            elif within(found.price, want):
                matched.append(name)
            else:
                different.append(name)
                if found.how is not Resolution.EXACT:
                    # Never a differently priced entry without a word in the log.
                    assert any(repr(name) in r.getMessage() for r in caplog.records), name
        share = len(matched) / len(models)
        assert share >= floor, (label, share, different[:10], unknown[:10])
        if label == "litellm":
            assert different == [], different


# --------------------------------------------------------------------------- the refresh


def test_refresh_ships_each_makers_name_as_litellm_prices_it(litellm_path: Path) -> None:
    document, left_out = shipped_document(FILE, as_of="2026-12-02", version="test")
    models = document["models"]
    assert models["grok-9"]["input"] == "1.25" and models["grok-9"]["provider"] == "xai"
    assert models["grok-9"]["tiers"] == [
        {"above": 200000, "input": "2.5", "output": "5", "cached_input": "0.2"}
    ]
    assert models["grok-9"]["max_output_tokens"] == 1_000_000
    assert models["mistral-huge-latest"]["input"] == "0.5"
    assert models["gemini-9-flash"]["input"] == "0.3"
    assert "dall-e-9" not in models and "open-model-7b" not in models  # hosts not shipped
    # A family whose snapshots agree gets an alias; one whose snapshots disagree does not.
    assert document["aliases"]["claude-opus-9"] == "claude-opus-9-20260601"
    assert "gpt-9" not in document["aliases"]
    assert models["default"]["input"] == "15"
    assert left_out == []
    # The shipped table answers every name as the LiteLLM file laid over it does.
    litellm = PriceTable.load(litellm_path)
    made = litellm_path.with_name("made.json")
    made.write_text(json.dumps(document), encoding="utf-8")
    shipped = PriceTable.load(made)
    for name in models:
        if name != "default":
            assert shipped.lookup(name) == litellm.lookup(name), name


def test_prices_refresh_writes_a_table_spendguard_loads(
    litellm_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "prices.json"
    code = main(
        [
            *("prices", "refresh", "--from", str(litellm_path), "--source-version", "9.9.9"),
            *("--as-of", "2026-12-02", "--out", str(out)),
        ]
    )
    assert code == 0
    assert "LiteLLM 9.9.9" in capsys.readouterr().err
    table = PriceTable.load(out)
    assert table.user_as_of == "2026-12-02"
    assert table.lookup("grok-9") == PriceTable.load(litellm_path).lookup("grok-9")
    again = tmp_path / "again.json"
    main(
        [
            *("prices", "refresh", "--from", str(litellm_path), "--as-of", "2026-12-02"),
            *("--source-version", "9.9.9", "--out", str(again)),
        ]
    )
    assert again.read_bytes() == out.read_bytes()  # deterministic: a reviewable diff
