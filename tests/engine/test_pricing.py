"""Price table: exact costs, name lookup rules, user files and their validation."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
import time
from decimal import Decimal
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spendguard.engine.pricing import Price, PriceTable, Resolution, Tier
from spendguard.errors import ConfigurationError
from spendguard.usage import Usage

PRICE_FIELDS = ("input", "output", "cached_input", "cache_write")


def shipped_entries() -> dict[str, dict[str, Any]]:
    """The shipped file read independently of spendguard.pricing."""
    text = resources.files("spendguard").joinpath("prices.json").read_text(encoding="utf-8")
    models: dict[str, dict[str, Any]] = json.loads(text)["models"]
    return models


def exact_micros(price: Price, usage: Usage) -> int:
    """Independent reference: rational arithmetic, then ceiling."""
    total = (
        Fraction(price.input) * usage.input_tokens
        + Fraction(price.output) * usage.output_tokens
        + Fraction(price.cached_input) * usage.cached_input_tokens
        + Fraction(price.cache_write) * usage.cache_write_tokens
    )
    return math.ceil(total)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- cost arithmetic


def test_cost_of_recorded_cached_chat_matches_the_table_entry() -> None:
    # openai-chat.json: prompt 1149 of which 1024 cached, completion 270. Usage.input_tokens
    # excludes cache reads, so 125 are billed at the normal input price.
    usage = Usage(input_tokens=1149 - 1024, cached_input_tokens=1024, output_tokens=270)
    entry = shipped_entries()["gpt-4o-mini"]
    expected = (
        Decimal(entry["input"]) * 125
        + Decimal(entry["cached_input"]) * 1024
        + Decimal(entry["output"]) * 270
    ).to_integral_value(rounding="ROUND_CEILING")
    table = PriceTable.load()
    assert table.cost("gpt-4o-mini-2024-07-18", usage) == int(expected)
    assert type(table.cost("gpt-4o-mini-2024-07-18", usage)) is int


def test_anthropic_cache_writes_and_reads_use_their_own_prices() -> None:
    usage = Usage(
        input_tokens=17, cache_write_tokens=2056, cached_input_tokens=10, output_tokens=100
    )
    entry = shipped_entries()["claude-sonnet-4"]
    expected = math.ceil(
        Fraction(entry["input"]) * 17
        + Fraction(entry["cache_write"]) * 2056
        + Fraction(entry["cached_input"]) * 10
        + Fraction(entry["output"]) * 100
    )
    assert PriceTable.load().cost("claude-sonnet-4-20250514", usage) == expected


def test_huge_counts_stay_exact_integers() -> None:
    price = Price.of("1.234567", "98.765431", "0.000001", "7.654321")
    usage = Usage(
        input_tokens=10**9 - 1,
        output_tokens=10**9 + 7,
        cached_input_tokens=999_999_937,
        cache_write_tokens=10**9,
    )
    cost = price.cost(usage)
    assert type(cost) is int
    assert cost == exact_micros(price, usage)
    # A float computation would already be off at this size.
    assert cost != int(
        1.234567 * (10**9 - 1) + 98.765431 * (10**9 + 7) + 0.000001 * 999_999_937 + 7.654321e9
    )


_PRICES = st.decimals(min_value=0, max_value=1_000_000, places=9, allow_nan=False)
_COUNTS = st.integers(min_value=0, max_value=10**9)


@given(_PRICES, _PRICES, _PRICES, _PRICES, _COUNTS, _COUNTS, _COUNTS, _COUNTS)
def test_cost_is_the_exact_sum_rounded_up_once(
    p1: Decimal, p2: Decimal, p3: Decimal, p4: Decimal, i: int, o: int, c: int, w: int
) -> None:
    price = Price(p1, p2, p3, p4)
    usage = Usage(input_tokens=i, output_tokens=o, cached_input_tokens=c, cache_write_tokens=w)
    cost = price.cost(usage)
    assert type(cost) is int and cost == exact_micros(price, usage)


def test_fractional_micro_usd_is_rounded_up_once() -> None:
    price = Price.of("0.15", "0.60", "0.075")
    # 1 input token at 0.15 micro-USD is charged 1 micro-USD, never 0.
    assert price.cost(Usage(input_tokens=1)) == 1
    # 20 tokens are exactly 3 micro-USD: no spurious extra micro.
    assert price.cost(Usage(input_tokens=20)) == 3
    # Rounding happens on the sum, not per component: 0.15 + 0.075 + 0.6 = 0.825 -> 1.
    assert price.cost(Usage(input_tokens=1, cached_input_tokens=1, output_tokens=1)) == 1
    assert price.cost(Usage()) == 0


def test_negative_counts_are_refused_rather_than_credited() -> None:
    with pytest.raises(ValueError, match="negative"):
        Price.of("1", "1").cost(Usage(output_tokens=-5))


def test_price_defaults_cache_prices_to_input_and_validates() -> None:
    price = Price.of("2.5", "10")
    assert price.cached_input == price.input == Decimal("2.5")
    assert price.cache_write == Decimal("2.5")
    with pytest.raises(ValueError):
        Price(Decimal("-1"), Decimal(1), Decimal(1), Decimal(1))
    with pytest.raises(ValueError):
        Price(Decimal("NaN"), Decimal(1), Decimal(1), Decimal(1))
    with pytest.raises(TypeError):
        Price(0.5, Decimal(1), Decimal(1), Decimal(1))  # type: ignore[arg-type]


def test_unknown_model_costs_none() -> None:
    assert PriceTable.load().cost("no-such-model-xyz", Usage(input_tokens=5)) is None


# --------------------------------------------------------------------------- lookup rules


@pytest.fixture
def table() -> PriceTable:
    # Distinct prices per entry, so a test can tell which entry a name resolved to.
    names = ["gpt-4o", "gpt-4o-mini", "claude-sonnet-4", "claude-sonnet-4-5", "o3", "o3-pro"]
    return PriceTable(
        {name: Price.of(str(i + 1), "1") for i, name in enumerate(names)}, as_of="2026-01-01"
    )


@pytest.mark.parametrize(
    ("model", "entry"),
    [
        ("gpt-4o-mini", "gpt-4o-mini"),
        ("GPT-4o-Mini", "gpt-4o-mini"),
        ("  gpt-4o  ", "gpt-4o"),
        ("openai/gpt-4o-mini", "gpt-4o-mini"),
        ("anthropic/claude-sonnet-4-5", "claude-sonnet-4-5"),
        ("azure/gpt-4o", "gpt-4o"),
        ("openrouter/openai/gpt-4o", "gpt-4o"),
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("claude-sonnet-4-20250514", "claude-sonnet-4"),
        ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
        ("claude-sonnet-4@20250514", "claude-sonnet-4"),
        ("us.anthropic.claude-sonnet-4-20250514-v1:0", "claude-sonnet-4"),
        ("anthropic.claude-sonnet-4-5-v1:0", "claude-sonnet-4-5"),
        ("o3-pro-2025-06-10", "o3-pro"),
        ("o3-2025-04-16", "o3"),
    ],
)
def test_lookup_rules(table: PriceTable, model: str, entry: str) -> None:
    assert table.resolve(model) == entry
    assert table.lookup(model) is table.lookup(entry)
    assert table.lookup(model) is not None


@pytest.mark.parametrize(
    ("model", "how"),
    [
        ("gpt-4o-mini", Resolution.EXACT),
        ("GPT-4o-Mini ", Resolution.EXACT),
        ("openrouter/openai/gpt-4o", Resolution.ROUTING_PREFIX),
        ("us.anthropic.claude-sonnet-4-5-v1:0", Resolution.VENDOR_FORM),
        ("claude-sonnet-4-5-20250929", Resolution.SNAPSHOT),
        ("openai/o3-2025-04-16", Resolution.SNAPSHOT),
    ],
)
def test_a_match_says_by_which_rule(table: PriceTable, model: str, how: Resolution) -> None:
    match = table.match(model)
    assert match is not None and match.how is how


def test_non_exact_names_are_logged_once_and_a_snapshot_warns(
    table: PriceTable, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spendguard")
    for _ in range(3):
        table.lookup("claude-sonnet-4-5-20250929")
        table.lookup("openai/gpt-4o")
        table.lookup("gpt-4o")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    snapshot = [m for level, m in lines if "claude-sonnet-4-5-20250929" in m]
    prefixed = [m for level, m in lines if "'openai/gpt-4o'" in m]
    assert len(snapshot) == 1 and len(prefixed) == 1
    assert (logging.WARNING, snapshot[0]) in lines and "family" in snapshot[0]
    assert not any("'gpt-4o'" in m for _, m in lines)  # an exact name says nothing


def test_aliases_price_as_their_entry_and_lose_to_an_entry_of_their_own() -> None:
    price, other = Price.of("1", "2"), Price.of("5", "6")
    table = PriceTable(
        {"real-model": price, "shadow": other},
        as_of="2026-01-01",
        aliases={"nick": "real-model", "shadow": "real-model"},
    )
    match = table.match("Nick")
    assert match is not None and (match.entry, match.how, match.via) == (
        "real-model",
        Resolution.ALIAS,
        "nick",
    )
    assert table.lookup("shadow") == other
    assert table.lookup("acme/nick") == price
    with pytest.raises(ValueError, match="no price"):
        PriceTable({"a": price}, as_of="2026-01-01", aliases={"b": "missing"})


def test_with_aliases_prices_gateway_names_as_their_target_or_their_own_price(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shipped = PriceTable.load()
    own = Price.of("0.5", "1")
    table = shipped.with_aliases(
        {"team-gpt": "openai/gpt-4o-mini", "house-model": own, "broken": "no-such-model-at-all"}
    )
    assert table.lookup("team-gpt") == shipped.lookup("gpt-4o-mini")
    match = table.match("team-gpt")
    assert match is not None and match.entry == "gpt-4o-mini" and match.from_file
    assert table.lookup("house-model") == own
    assert table.lookup("broken") is None
    assert any("'broken'" in r.getMessage() for r in caplog.records)
    assert shipped.lookup("team-gpt") is None  # the original table is unchanged


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4",  # shorter than every entry
        "gpt-4ox",  # prefix, but not at a '-' boundary
        "gpt-4o.5",
        "o3x-mini",
        "o",
        "mini",
        "ft:gpt-4o-mini-2024-07-18:org::abc",  # fine-tunes are priced differently
        # No shared prefix prices a name: a typo, a variant, a newer sibling are unknown.
        "gpt-4o-mni",
        "gpt-4o-mini-preview",
        "claude-sonnet-4-5-latest",
        "claude-sonnet-4-7",
        "gpt-4o-mini-2024-07",
        "",
        "   ",
        "/",
        "openai/",
        "-",
        "-2024-07-18",
        "@20250101",
        # Variants bill audio, images, searches... apart: never the text model's price.
        "gpt-4o-mini-audio-preview",
        "gpt-4o-audio-preview-2024-12-17",
        "gpt-4o-search-preview",
        "gpt-4o-realtime-preview",
        "gpt-4o-mini-transcribe",
        "gpt-4o-mini-tts",
        "o3-deep-research",
        "gpt-4o-image",
    ],
)
def test_lookup_misses(table: PriceTable, model: str) -> None:
    assert table.resolve(model) is None
    assert table.lookup(model) is None


def test_lookup_of_dated_shipped_models() -> None:
    shipped = PriceTable.load()
    # The names the APIs answer with are entries (or aliases) of their own: no rule needed.
    for model, entry in [
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini-2024-07-18"),
        ("claude-sonnet-4-20250514", "claude-sonnet-4"),
        ("gpt-5-nano-2025-08-07", "gpt-5-nano-2025-08-07"),
        ("gpt-4.1-nano-2025-04-14", "gpt-4.1-nano-2025-04-14"),
        ("text-embedding-ada-002-v2", "text-embedding-ada-002-v2"),
        ("claude-opus-4-5-20251101", "claude-opus-4-5-20251101"),
    ]:
        match = shipped.match(model)
        assert match is not None and match.entry == entry, model
        assert match.how in (Resolution.EXACT, Resolution.ALIAS), model
    # An old snapshot with its own price is matched exactly, before the date is stripped.
    assert shipped.resolve("gpt-4o-2024-05-13") == "gpt-4o-2024-05-13"
    assert shipped.lookup("gpt-4o-2024-05-13") != shipped.lookup("gpt-4o")
    # A pricier sibling never falls back to the cheaper family entry.
    assert shipped.resolve("o3-pro") == "o3-pro"
    assert shipped.lookup("o3-pro") != shipped.lookup("o3")


@given(st.text(max_size=300))
def test_lookup_never_crashes(model: str) -> None:
    shipped = PriceTable.load()
    price = shipped.lookup(model)
    assert price is None or isinstance(price, Price)
    assert (model in shipped) == (price is not None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("model", "entry"),
    [
        ("-" * 50_000, None),
        ("gpt-4o-" * 20_000, None),  # no rule strips a run of words
        ("a" * 200_000, None),
        ("\x00\ud800", None),
        ("gpt-4o-mini\n", "gpt-4o-mini"),  # surrounding whitespace is not part of a name
        ("😀/😀", None),
    ],
    ids=["dashes", "repeated-family", "long", "nul-surrogate", "newline", "emoji"],
)
def test_lookup_of_hostile_strings(model: str, entry: str | None) -> None:
    shipped = PriceTable.load()
    started = time.perf_counter()
    price = shipped.lookup(model)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"lookup took {elapsed:.2f} s: matching must stay linear"
    # Never a price of its own: only the entry the name resolves to, or none at all.
    assert shipped.resolve(model) == entry
    if entry is None:
        assert price is None and model not in shipped
    else:
        assert isinstance(price, Price) and price == shipped.lookup(entry)


def test_lookup_of_non_string_is_none() -> None:
    assert PriceTable.load().lookup(None) is None  # type: ignore[arg-type]


# --------------------------------------------------------------------------- shipped table


def test_shipped_table_loads_with_as_of_and_source() -> None:
    shipped = PriceTable.load()
    assert dt.date.fromisoformat(shipped.as_of) <= dt.date.today()
    assert shipped.user_as_of is None
    raw = json.loads(resources.files("spendguard").joinpath("prices.json").read_text())
    assert raw["as_of"] == shipped.as_of
    assert isinstance(raw["source"], str) and raw["source"]
    assert shipped.models() == sorted(raw["models"])


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4.1",
        "gpt-4.1-mini",
        "gpt-4.1-nano",
        "gpt-5",
        "gpt-5-mini",
        "gpt-5-nano",
        "o3",
        "o4-mini",
        "o1",
        "gpt-3.5-turbo",
        "text-embedding-3-small",
        "text-embedding-3-large",
        "text-embedding-ada-002",
        "claude-opus-4-1",
        "claude-opus-4-5",
        "claude-sonnet-4",
        "claude-sonnet-4-5",
        "claude-sonnet-4-6",
        "claude-haiku-4-5",
        "claude-3-5-haiku",
        "claude-3-7-sonnet",
        # The current models an earlier table charged the default.
        "gpt-5.6",
        "claude-sonnet-5",
        "claude-opus-5",
        "claude-haiku-5-5",
        "gemini-3-flash-preview",
        "gemini-3.1-pro-preview",
        "gemini-3.5-flash",
        "deepseek-v4-pro",
        "deepseek-v4-flash",
        "grok-4.3",
        "deepseek-v3.2",
        "deepseek-r1",
        "mistral-large-latest",
        "mistral-medium-latest",
        "codestral-latest",
    ],
)
def test_shipped_table_has_the_common_models(model: str) -> None:
    assert PriceTable.load().resolve(model) == model


def test_shipped_prices_are_internally_consistent() -> None:
    for name, entry in shipped_entries().items():
        if name == "default":
            continue  # the fallback for unknown models; checked below
        price = PriceTable.load().lookup(name)
        assert price is not None
        # Cache reads are never dearer than fresh input.
        assert price.cached_input <= price.input, name
        if name.startswith("claude-"):
            assert price.output > price.input, name
            assert price.cache_write > price.input, name
            if name != "claude-3-haiku":
                # Anthropic's published multipliers: 5-minute writes 1.25x, reads 0.1x of
                # input (Claude 3 Haiku predates them: $0.30 writes on $0.25 input).
                assert price.cache_write == price.input * Decimal("1.25"), name
                assert price.cached_input <= price.input * Decimal("0.1"), name
        elif name.startswith("text-embedding-"):
            assert price.output == 0, name
        # Prices are written as strings so the file itself carries exact decimals.
        prices = [entry, *entry.get("tiers", [])]
        assert all(isinstance(v, str) for e in prices for k, v in e.items() if k in PRICE_FIELDS), (
            name
        )
        for tier in price.tiers:  # long context costs more, never less
            assert tier.price.input >= price.input and tier.price.output >= price.output, name


def test_default_fallback_price_is_not_cheaper_than_common_models() -> None:
    # An unknown model is charged the "default" entry (unknown_model=default_price): it must
    # err towards the operator, so it is at least the price of the mainstream shipped models.
    table = PriceTable.load()
    fallback = table.lookup("default")
    assert fallback is not None
    for name in ("gpt-4o", "gpt-4.1", "gpt-5", "claude-sonnet-4-5", "claude-opus-4-5"):
        price = table.lookup(name)
        assert price is not None
        assert fallback.input >= price.input and fallback.output >= price.output, name


# --------------------------------------------------------------------------- user files


def test_user_json_overrides_and_extends(tmp_path: Path) -> None:
    path = write(
        tmp_path / "prices.json",
        json.dumps(
            {
                "as_of": "2026-09-01",
                "models": {
                    "gpt-4o-mini": {"input": "0.2", "output": "0.9"},
                    "My-Model": {"input": 3, "output": 0.1, "cached_input": "1e-1"},
                },
            }
        ),
    )
    table = PriceTable.load(path)
    shipped = PriceTable.load()
    # Override: the user's entry wins, through every lookup rule.
    assert table.lookup("gpt-4o-mini") == Price.of("0.2", "0.9")
    assert table.lookup("openai/gpt-4o-mini-2024-07-18") == Price.of("0.2", "0.9")
    assert table.lookup("gpt-4o-mini") != shipped.lookup("gpt-4o-mini")
    # Extension: a new model, stored case-insensitively, JSON numbers exact (0.1 not 0.1000...).
    assert table.lookup("my-model") == Price(Decimal(3), Decimal("0.1"), Decimal("0.1"), Decimal(3))
    # The snapshot the API answers with, priced as its family in the shipped table, follows
    # the new family price; a snapshot with a price of its own keeps it.
    assert table.lookup("gpt-4o-mini-2024-07-18") == Price.of("0.2", "0.9")
    assert shipped.lookup("gpt-4o-2024-05-13") != shipped.lookup("gpt-4o")
    gpt4o = PriceTable.load(
        write(tmp_path / "o.json", '{"models": {"gpt-4o": {"input": "1", "output": "1"}}}')
    )
    assert gpt4o.lookup("gpt-4o-2024-05-13") == shipped.lookup("gpt-4o-2024-05-13")
    # Everything else shipped is still there.
    assert table.lookup("claude-sonnet-4") == shipped.lookup("claude-sonnet-4")
    assert set(table.models()) == set(shipped.models()) - {"gpt-4o-mini-2024-07-18"} | {"my-model"}
    assert table.as_of == shipped.as_of
    assert table.user_as_of == "2026-09-01"


def test_user_yaml_overrides_and_extends(tmp_path: Path) -> None:
    path = write(
        tmp_path / "prices.yaml",
        """
as_of: 2026-09-01          # unquoted: YAML reads a date
source: negotiated contract
models:
  claude-sonnet-4-5:
    input: 0.1              # a YAML float must stay exactly 0.1
    output: "2.5"
    cached_input: 0.01
    cache_write: 0.125
  local-llama:
    input: 0
    output: 0
""",
    )
    table = PriceTable.load(path)
    assert table.lookup("claude-sonnet-4-5-20250929") == Price(
        Decimal("0.1"), Decimal("2.5"), Decimal("0.01"), Decimal("0.125")
    )
    assert table.lookup("local-llama") == Price.of(0, 0)
    assert table.cost("local-llama", Usage(input_tokens=10**6, output_tokens=10**6)) == 0
    assert table.user_as_of == "2026-09-01"
    # 30 tokens at exactly 0.1 cost exactly 3 micro-USD; a binary 0.1 would round up to 4.
    assert table.cost("claude-sonnet-4-5", Usage(input_tokens=30)) == 3
    assert table.lookup("claude-sonnet-4") == PriceTable.load().lookup("claude-sonnet-4")


def test_yml_extension_and_user_file_without_as_of(tmp_path: Path) -> None:
    path = write(tmp_path / "p.yml", "models:\n  x-model: {input: 1, output: 2}\n")
    table = PriceTable.load(path)
    assert table.lookup("x-model") == Price.of(1, 2)
    assert table.user_as_of is None


def test_user_entry_wins_over_a_longer_shipped_prefix_only_for_its_own_name(tmp_path: Path) -> None:
    path = write(tmp_path / "p.json", '{"models": {"gpt-4o": {"input": "9", "output": "9"}}}')
    table = PriceTable.load(path)
    assert table.lookup("gpt-4o-2024-08-06") == Price.of(9, 9)
    # gpt-4o-mini is a different model with its own shipped entry.
    assert table.lookup("gpt-4o-mini") == PriceTable.load().lookup("gpt-4o-mini")


INVALID_FILES: list[tuple[str, str, str]] = [
    # (file name, content, text the error must contain besides the file name)
    ("prices.yaml", "models:\n  gpt-x: {input: 1, output: -1}\n", "models.gpt-x.output"),
    ("prices.yaml", "models:\n  gpt-x: {input: abc, output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: .nan, output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: .inf, output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: true, output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: null, output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: [1], output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: '', output: 1}\n", "models.gpt-x.input"),
    ("prices.yaml", "models:\n  gpt-x: {input: '1e9', output: 1}\n", "models.gpt-x.input"),
    (
        "prices.yaml",
        "models:\n  gpt-x: {input: 1, output: 1, cached_input: -0.5}\n",
        "models.gpt-x.cached_input",
    ),
    (
        "prices.yaml",
        "models:\n  gpt-x: {input: 1, output: 1, cache_write: Infinity}\n",
        "models.gpt-x.cache_write",
    ),
    ("prices.yaml", "models:\n  gpt-x: {input: 1}\n", "models.gpt-x.output"),
    ("prices.yaml", "models:\n  gpt-x: {output: 1}\n", "models.gpt-x.input"),
    (
        "prices.yaml",
        "models:\n  gpt-x: {input: 1, output: 1, cache_read: 1}\n",
        "models.gpt-x.cache_read",
    ),
    ("prices.yaml", "models:\n  gpt-x: 5\n", "models.gpt-x"),
    (
        "prices.yaml",
        "models:\n  gpt-x: {input: 1, output: 1}\n  GPT-X: {input: 1, output: 1}\n",
        "models.GPT-X",
    ),
    ("prices.yaml", "models:\n  123: {input: 1, output: 1}\n", "models.123"),
    ("prices.yaml", "models: [gpt-x]\n", "models"),
    ("prices.yaml", "as_of: 2026-01-01\n", "models"),
    ("prices.yaml", "modles: {}\n", "modles"),
    ("prices.yaml", "as_of: yesterday\nmodels: {}\n", "as_of"),
    ("prices.yaml", "as_of: '2026-02-30'\nmodels: {}\n", "as_of"),
    ("prices.yaml", "source: [1]\nmodels: {}\n", "source"),
    ("prices.yaml", "- a\n- b\n", "top level"),
    ("prices.yaml", "", "top level"),
    ("prices.yaml", "models: {gpt-x: {input: 1, output: 1}\n", "invalid YAML"),
    ("prices.json", '{"models": {"gpt-x": {"input": NaN, "output": 1}}}', "models.gpt-x.input"),
    (
        "prices.json",
        '{"models": {"gpt-x": {"input": 1, "output": -Infinity}}}',
        "models.gpt-x.output",
    ),
    ("prices.json", '{"models": {"gpt-x": {"input": "1", "output": "-2"}}}', "models.gpt-x.output"),
    (
        "prices.json",
        '{"models": {"gpt-x": {"input": 1, "output": 1, "extra": 1}}}',
        "models.gpt-x.extra",
    ),
    ("prices.json", '{"models": {"gpt-x": {"input": 1, "output": 1}, "gpt-x": {}}}', "gpt-x"),
    ("prices.json", '{"models": {', "invalid JSON"),
    ("prices.json", "[]", "top level"),
    ("prices.txt", '{"models": {}}', "extension"),
    ("prices", '{"models": {}}', "extension"),
]


@pytest.mark.parametrize(("name", "content", "fragment"), INVALID_FILES)
def test_invalid_user_file_names_file_and_field(
    tmp_path: Path, name: str, content: str, fragment: str
) -> None:
    path = write(tmp_path / name, content)
    with pytest.raises(ConfigurationError) as info:
        PriceTable.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert fragment in message, message


def test_invalid_price_message_has_the_documented_shape(tmp_path: Path) -> None:
    path = write(tmp_path / "prices.yaml", "models:\n  gpt-x: {input: 1, output: -1}\n")
    with pytest.raises(ConfigurationError) as info:
        PriceTable.load(path)
    assert re.fullmatch(
        rf"{re.escape(str(path))}: models\.gpt-x\.output: must be a non-negative number",
        str(info.value),
    )


def test_missing_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not found") as info:
        PriceTable.load(tmp_path / "absent.yaml")
    assert "absent.yaml" in str(info.value)


def test_undecodable_file_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_bytes(b'{"models": {"\xff": {}}}')
    with pytest.raises(ConfigurationError, match=r"prices\.json"):
        PriceTable.load(path)


def test_user_file_accepts_str_paths(tmp_path: Path) -> None:
    path = write(tmp_path / "prices.json", '{"models": {"m": {"input": "1", "output": "2"}}}')
    assert PriceTable.load(str(path)).lookup("m") == Price.of(1, 2)


# --------------------------------------------------------------------------- LiteLLM's file

# Entries in the shape of LiteLLM's model_prices_and_context_window.json (numbers, not strings,
# as LiteLLM writes them), with the kinds a loader must skip.
LITELLM = """{
    "sample_spec": {
        "input_cost_per_token": 0.0,
        "litellm_provider": "one of https://docs.litellm.ai/docs/providers",
        "max_tokens": "LEGACY parameter.",
        "mode": "one of: chat, embedding, completion, image_generation, audio_transcription"
    },
    "gemini/gemini-2.5-flash": {
        "cache_read_input_token_cost": 7.5e-08,
        "input_cost_per_audio_token": 1e-06,
        "input_cost_per_token": 3e-07,
        "input_cost_per_token_above_200k_tokens": 6e-07,
        "litellm_provider": "gemini",
        "max_input_tokens": 1048576,
        "mode": "chat",
        "output_cost_per_token": 2.5e-06,
        "supports_vision": true
    },
    "claude-sonnet-4-5": {
        "cache_creation_input_token_cost": 3.75e-06,
        "cache_read_input_token_cost": 3e-07,
        "input_cost_per_token": 3e-06,
        "litellm_provider": "anthropic",
        "mode": "chat",
        "output_cost_per_token": 1.5e-05
    },
    "acme-odd": {
        "input_cost_per_token": 1.1e-07,
        "output_cost_per_token": 0.1234567890123456789e-06,
        "litellm_provider": "acme",
        "mode": "completion"
    },
    "acme-embed-v1": {
        "input_cost_per_token": 2e-08,
        "litellm_provider": "acme",
        "mode": "embedding"
    },
    "gpt-5.4-pro": {
        "input_cost_per_token": 3e-05,
        "litellm_provider": "openai",
        "mode": "responses",
        "output_cost_per_token": 0.00018
    },
    "1024-x-1024/dall-e-2": {
        "input_cost_per_pixel": 1.9e-08,
        "litellm_provider": "openai",
        "mode": "image_generation",
        "output_cost_per_pixel": 0.0
    },
    "acme-tts": {
        "input_cost_per_token": 3e-07,
        "litellm_provider": "acme",
        "mode": "audio_speech",
        "output_cost_per_token": 2.5e-06
    },
    "acme-unpriced": {"litellm_provider": "acme", "mode": "chat", "max_tokens": 8192},
    "acme-half": {"input_cost_per_token": 1e-06, "litellm_provider": "acme", "mode": "chat"},
    "acme-broken": {
        "input_cost_per_token": -1e-06,
        "output_cost_per_token": 1e-06,
        "litellm_provider": "acme",
        "mode": "chat"
    }
}"""


def test_a_litellm_price_file_is_read_per_token_to_per_million_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = PriceTable.load(write(tmp_path / "model_prices_and_context_window.json", LITELLM))
    flash = table.match("gemini/gemini-2.5-flash")
    assert flash is not None and flash.from_file and flash.provider == "gemini"
    # The long-context price is a tier: above 200K prompt tokens, all of it at 0.6 per 1M.
    assert flash.price == Price.of(
        "0.3", "2.5", cached_input="0.075", tiers=[Tier(200_000, Price.of("0.6", "2.5", "0.075"))]
    )
    assert flash.price.cost(Usage(input_tokens=200_000)) == 60_000
    assert flash.price.cost(Usage(input_tokens=200_001)) == math.ceil(Fraction("0.6") * 200_001)
    assert table.lookup("claude-sonnet-4-5-20250929") == Price.of(
        "3", "15", cached_input="0.3", cache_write="3.75"
    )
    # Every digit of the JSON number is kept: no binary float ever held it.
    odd = table.lookup("acme-odd")
    assert odd is not None and odd.input == Decimal("0.11")
    assert odd.output == Decimal("0.1234567890123456789")
    usage = Usage(input_tokens=7, output_tokens=3)
    assert odd.cost(usage) == math.ceil(
        Fraction("0.11") * 7 + Fraction("0.1234567890123456789") * 3
    )
    assert table.lookup("acme-embed-v1") == Price.of("0.02", "0")  # embeddings: input only
    assert table.lookup("gpt-5.4-pro") == Price.of("30", "180")  # responses mode is priced
    assert table.user_as_of is None


@pytest.mark.parametrize(
    "name", ["1024-x-1024/dall-e-2", "acme-tts", "acme-unpriced", "acme-half", "acme-broken"]
)
def test_a_litellm_file_skips_what_is_not_priced_per_text_token(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    table = PriceTable.load(write(tmp_path / "litellm.json", LITELLM))
    assert table.match(name) is None
    assert "sample_spec" not in table
    # The invalid entry is skipped (one odd entry must not refuse thousands), and said so.
    assert any("acme-broken.input_cost_per_token" in r.getMessage() for r in caplog.records)


def test_a_litellm_file_overrides_the_shipped_entries_it_names(tmp_path: Path) -> None:
    table = PriceTable.load(write(tmp_path / "litellm.json", LITELLM))
    shipped = PriceTable.load()
    assert table.lookup("claude-sonnet-4-5") == shipped.lookup("claude-sonnet-4-5")
    match = table.match("claude-sonnet-4-5")
    assert match is not None and match.from_file and match.provider == "anthropic"
    assert table.lookup("gpt-4o") == shipped.lookup("gpt-4o")  # not in the file: shipped
    unchanged = table.match("gpt-4o")
    assert unchanged is not None and not unchanged.from_file


def test_a_spendguard_file_is_not_mistaken_for_litellm(tmp_path: Path) -> None:
    # A typo in spendguard's own format still names the field, not "no prices".
    with pytest.raises(ConfigurationError, match="modles: unknown field"):
        PriceTable.load(write(tmp_path / "p.json", '{"modles": {"x": {"input": 1}}}'))


# --------------------------------------------------------------------------- shipped families


@pytest.mark.parametrize(
    ("model", "entry", "provider"),
    [
        ("gemini-2.5-flash", "gemini-2.5-flash", "google"),
        ("models/gemini-2.5-pro", "gemini-2.5-pro", "google"),
        ("gemini/gemini-3.5-flash", "gemini-3.5-flash", "google"),
        ("mistral-large-latest", "mistral-large-latest", "mistral"),
        ("mistral/mistral-medium-latest", "mistral-medium-latest", "mistral"),
        ("deepseek-chat", "deepseek-chat", "deepseek"),
        ("deepseek/deepseek-reasoner", "deepseek-reasoner", "deepseek"),
        (
            "meta-llama/Llama-3.3-70B-Instruct-Turbo",
            "meta-llama/llama-3.3-70b-instruct-turbo",
            "together",
        ),
        ("groq/llama-3.3-70b-versatile", "llama-3.3-70b-versatile", "groq"),
        ("xai/grok-4.3", "grok-4.3", "xai"),
        ("grok-code-fast-1", "grok-code-fast-1", "xai"),
        ("gpt-5.4-2026-03-05", "gpt-5.4-2026-03-05", "openai"),
        ("gpt-5.4-mini", "gpt-5.4-mini", "openai"),
        ("gpt-5.5", "gpt-5.5", "openai"),
        ("gpt-5.3-codex", "gpt-5.3-codex", "openai"),
        ("claude-sonnet-4-6", "claude-sonnet-4-6", "anthropic"),
        ("us.amazon.nova-pro-v1:0", "us.amazon.nova-pro-v1:0", "amazon"),
        ("command-a-03-2025", "command-a-03-2025", "cohere"),
    ],
)
def test_shipped_table_prices_every_major_provider(model: str, entry: str, provider: str) -> None:
    match = PriceTable.load().match(model)
    assert match is not None and (match.entry, match.provider) == (entry, provider)


def test_gemini_flash_is_no_longer_charged_the_default() -> None:
    table = PriceTable.load()
    flash, fallback = table.lookup("gemini-2.5-flash"), table.lookup("default")
    assert flash is not None and fallback is not None
    assert fallback.input / flash.input == 50  # what the default overcharged before


def test_shipped_table_says_where_each_providers_prices_come_from() -> None:
    raw = json.loads(resources.files("spendguard").joinpath("prices.json").read_text())
    providers = {e["provider"] for e in raw["models"].values()}
    assert {"openai", "anthropic", "google", "mistral", "deepseek", "xai"} <= providers
    assert {"amazon", "cohere", "groq", "together"} <= providers
    assert set(raw["sources"]) == providers
    assert all(raw["sources"].values())
    assert "LiteLLM" in raw["source"]


def test_a_miss_costs_the_same_in_a_table_of_thousands(tmp_path: Path) -> None:
    # LiteLLM's file has thousands of entries; a name none prices is looked up on every
    # request, so the prefix search must not walk the whole table.
    price = Price.of("1", "1")
    table = PriceTable({f"vendor{i}/model-{i}-x": price for i in range(20_000)}, as_of="2026-01-01")
    started = time.perf_counter()
    for i in range(200):
        assert table.resolve(f"no-such-model-{i}-at-all") is None
    assert time.perf_counter() - started < 0.5


# --------------------------------------------------------------------------- resolved names


def test_resolved_names_are_remembered_boundedly_and_answer_as_before() -> None:
    """Each name is resolved once per table (every request prices its model two or three
    times): the remembered answer is the rule's answer, for priced and unpriced names alike,
    and a flood of distinct names (they come from clients) keeps the memo bounded."""
    table = PriceTable.load()
    names = [
        "gpt-4o-mini",
        "gpt-4o-mini-2024-07-18",
        "openai/gpt-4o-mini",
        "GPT-4O-MINI ",
        "claude-sonnet-4-5-20250929",
        "no-such-model",
        "",
    ]
    first = [table.resolve(name) for name in names]
    assert first[0] == first[2] == first[3] == "gpt-4o-mini"
    assert first[1] == "gpt-4o-mini-2024-07-18"
    assert first[5] is None and first[6] is None
    assert [table.resolve(name) for name in names] == first  # remembered: the same answers
    for i in range(5_000):
        assert table.resolve(f"flood-{i}") is None
    assert len(table._resolved) <= 1024
    assert [table.resolve(name) for name in names] == first


# --------------------------------------------------------------------------- tiers, encoding

prices = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False, allow_infinity=False)


@given(prices, prices, prices, prices, st.integers(1, 10**6), prices, prices)
def test_an_encoded_price_decodes_to_the_same_price(
    i: Decimal, o: Decimal, c: Decimal, w: Decimal, above: int, ti: Decimal, to: Decimal
) -> None:
    for price in (
        Price.of(i, o, c, w),
        Price.of(i, o, c, w, tiers=[Tier(above, Price.of(ti, to))]),
    ):
        text = price.encode()
        assert Price.decode(text) == price
        assert "e" not in text.lower()  # plain decimals: the string is its own record


@pytest.mark.parametrize(
    "text",
    [
        "1e999999999,1,1,1",
        "1,2,3,4E+2",
        "",
        "1,2,3",
        "1,2,3,x",
        "1,2,3,4|",
        "1,2,3,4|x:1,2,3,4",
        "1,2,3,-4",
        "1,2,3,4|0:1,1,1,1",
    ],
)
def test_a_price_string_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Price.decode(text)


def test_a_tier_bills_the_whole_request_once_the_prompt_passes_its_threshold() -> None:
    price = Price.of(
        "1", "2", "0.1", "1.25", tiers=[Tier(200_000, Price.of("2", "3", "0.2", "2.5"))]
    )
    # The prompt is input, cache reads and cache writes together.
    at = Usage(input_tokens=100_000, cached_input_tokens=60_000, cache_write_tokens=40_000)
    assert price.cost(at) == 100_000 + 6_000 + 50_000
    above = Usage(
        input_tokens=100_001,
        cached_input_tokens=60_000,
        cache_write_tokens=40_000,
        output_tokens=10,
    )
    assert price.cost(above) == 200_002 + 12_000 + 100_000 + 30
    with pytest.raises(ValueError):
        Price.of("1", "1", tiers=[Tier(10, Price.of("1", "1")), Tier(5, Price.of("1", "1"))])
