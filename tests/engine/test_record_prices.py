"""One price from estimate to settlement: a record carries the unit prices it was estimated
at, and settlement charges those, whatever price table the settling process has. A record of
an earlier release (no price) and one whose price does not read are priced by the table."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from math import ceil
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from spendguard import Settings
from spendguard.cli import main
from spendguard.engine.costing import Coster
from spendguard.engine.pricing import Price, PriceTable
from spendguard.engine.worker import SettlementWorker
from spendguard.ledger import Ledger
from spendguard.ledger.schema import charges, records
from spendguard.limits import KeyCodec
from spendguard.settings import UnknownModel
from spendguard.usage import Usage
from tests.engine.helpers import ALPHA, running_guard
from tests.support import make_record, sql_rows

CODEC = KeyCodec("quota", timedelta(days=2))
T0 = datetime(2026, 10, 1, 12, tzinfo=UTC)

# The gateway's own prices (USD per 1M tokens): gpt-4o-mini unlike the shipped list price, and
# a model the shipped table does not know (a worker without this file default-prices it).
GATEWAY = {
    "gpt-4o-mini": {"input": "0.5", "output": "1.5", "cached_input": "0.05"},
    "house-model": {"input": "0.013", "output": "0.027"},
}
LATER = {  # the same models after a price change
    "gpt-4o-mini": {"input": "0.7", "output": "2.1", "cached_input": "0.07"},
    "house-model": {"input": "0.02", "output": "0.04"},
}
CASES = (
    ("gpt-4o-mini", Usage(input_tokens=1200, output_tokens=345, cached_input_tokens=678)),
    ("house-model", Usage(input_tokens=101, output_tokens=7)),
)


def expected(prices: dict[str, dict[str, str]], model: str, usage: Usage) -> int:
    """What ``usage`` costs at ``prices``, worked out here: each kind of token at its price
    per million (cache reads at the input price unless given), rounded up to a micro-USD."""
    p = prices[model]
    cached = p.get("cached_input", p["input"])
    exact = (
        Fraction(p["input"]) * usage.input_tokens
        + Fraction(p["output"]) * usage.output_tokens
        + Fraction(cached) * usage.cached_input_tokens
        + Fraction(p.get("cache_write", p["input"])) * usage.cache_write_tokens
    )
    return ceil(exact)


def price_file(directory: Path, name: str, models: dict[str, dict[str, str]]) -> Path:
    path = directory / name
    path.write_text(json.dumps({"as_of": "2026-11-01", "models": models}))
    return path


def shipped_coster() -> Coster:
    """A settling process without the gateway's price file: the shipped table only."""
    return Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)


async def gateway_records(url: str, prices: Path) -> dict[str, tuple[str, Usage]]:
    """Serve ``CASES`` through a gateway pricing from ``prices``; its records by id."""
    out: dict[str, tuple[str, Usage]] = {}
    async with running_guard(Settings(database_url=url, prices=prices)) as g:
        for model, usage in CASES:
            decision = await g.preflight(ALPHA, g.clock())
            record = await g.postflight(
                decision, model=model, route="/v1/chat/completions", status_code=200, usage=usage
            )
            assert record is not None
            out[record.id] = (model, usage)
        await g.recorder.flush()
    return out


async def charged(url: str) -> dict[str, int]:
    rows = await sql_rows(url, sa.select(charges.c.record_id, charges.c.amount_micros))
    return {str(rid): int(amount) for rid, amount in rows}


@pytest.fixture
async def ledger_of(database_url: str) -> AsyncIterator[Ledger]:
    """The ledger as a separate settling process opens it."""
    led = Ledger(database_url)
    await led.connect()
    await led.init_schema()
    try:
        yield led
    finally:
        await led.disconnect()


@pytest.mark.anyio
async def test_a_worker_with_another_table_charges_what_the_gateway_estimated(
    database_url: str, tmp_path: Path, ledger_of: Ledger
) -> None:
    written = await gateway_records(database_url, price_file(tmp_path, "gw.json", GATEWAY))
    other = shipped_coster()
    for model, usage in CASES:
        # Were settlement to price by its own table, these charges would differ.
        assert other.cost(model, usage) != expected(GATEWAY, model, usage)
    result = await SettlementWorker(ledger_of, None, other, CODEC).run_once()
    want = {rid: expected(GATEWAY, model, usage) for rid, (model, usage) in written.items()}
    assert result.settled == 2 and result.total_micros == sum(want.values())
    assert result.estimate_error_micros == 0  # the charge is the estimate
    assert await charged(database_url) == want
    estimates = await sql_rows(database_url, sa.select(records.c.id, records.c.estimate_micros))
    assert dict(estimates) == want


@pytest.mark.anyio
async def test_a_changed_price_applies_to_inferences_after_it_not_before(
    database_url: str, tmp_path: Path, ledger_of: Ledger
) -> None:
    before = await gateway_records(database_url, price_file(tmp_path, "gw.json", GATEWAY))
    # The operator changes the price file and restarts the gateway.
    after = await gateway_records(database_url, price_file(tmp_path, "later.json", LATER))
    await SettlementWorker(ledger_of, None, shipped_coster(), CODEC).run_once()
    want = {rid: expected(GATEWAY, m, u) for rid, (m, u) in before.items()}
    want |= {rid: expected(LATER, m, u) for rid, (m, u) in after.items()}
    assert await charged(database_url) == want
    assert len(set(want.values())) == 4


def test_spendguard_settle_charges_what_the_gateway_estimated(
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The incident: a `spendguard settle` run without the gateway's SPENDGUARD_PRICES.
    gateway = price_file(tmp_path, "gw.json", GATEWAY)
    written = anyio.run(gateway_records, database_url, gateway)
    monkeypatch.setenv("SPENDGUARD_DATABASE_URL", database_url)
    monkeypatch.delenv("SPENDGUARD_PRICES", raising=False)
    monkeypatch.delenv("SPENDGUARD_REDIS_URL", raising=False)
    assert main(["settle", "--json"]) == 0
    settled = json.loads(capsys.readouterr().out)
    want = {rid: expected(GATEWAY, model, usage) for rid, (model, usage) in written.items()}
    assert settled == {"settled": 2, "total_micros": sum(want.values())}
    assert anyio.run(charged, database_url) == want


# -- records the table prices ----------------------------------------------------------------

# A settling table of its own: "m" (the model of tests.support.make_record) at 2 in, 3 out.
TABLE = PriceTable({"m": Price.of("2", "3"), "default": Price.of("50", "50")}, as_of="2026-11-01")


def table_worker(ledger: Ledger) -> SettlementWorker:
    return SettlementWorker(ledger, None, Coster(TABLE, UnknownModel.DEFAULT_PRICE), CODEC)


async def settle_records(ledger: Ledger, batch: Sequence[Any]) -> dict[str, int]:
    await ledger.insert_records(batch)
    await table_worker(ledger).run_once()
    return await charged(ledger.url)


@pytest.mark.anyio
async def test_a_record_without_a_price_is_priced_by_the_settling_table(ledger: Ledger) -> None:
    old = make_record("old", T0, 40, price=None)  # written before records carried a price
    new = make_record("new", T0, 40)  # carries one micro-USD per token
    assert await settle_records(ledger, [old, new]) == {"old": 40 * 2, "new": 40}


@pytest.mark.anyio
async def test_a_record_charged_nothing_stays_free(ledger: Ledger) -> None:
    # Its model had no price when it ran (unknown_model=free): a table knowing it now does
    # not charge it after the fact.
    assert await settle_records(ledger, [make_record("free", T0, 40, price="")]) == {"free": 0}


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["garbage", "1,2,3", "1e999999999,1,1,1", "-1,1,1,1"])
async def test_a_price_that_does_not_read_falls_back_to_the_table_and_is_logged_once(
    ledger: Ledger, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    batch = [make_record(f"bad{n}", T0, 40, price=bad) for n in range(3)]
    batch.append(make_record("good", T0, 40))
    with caplog.at_level(logging.ERROR, logger="spendguard.worker"):
        got = await settle_records(ledger, batch)
    assert got == {"bad0": 80, "bad1": 80, "bad2": 80, "good": 40}  # the batch settled whole
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and repr(bad) in errors[0].getMessage()


@pytest.mark.anyio
async def test_a_batch_reads_each_price_once(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiered = "0.5,1.5,0.05,0.5|1000:1,3,0.1,1"
    read: list[str] = []
    decode = Price.decode

    def counting(text: str) -> Price:
        read.append(text)
        return decode(text)

    monkeypatch.setattr(Price, "decode", counting)
    batch = [make_record(f"r{n}", T0, 10 + 995 * (n % 2), price=tiered) for n in range(6)]
    got = await settle_records(ledger, batch)
    assert read == [tiered]
    # 10 input tokens at 0.5; 1005 (above the tier) at 1 each.
    assert got == {f"r{n}": 5 if n % 2 == 0 else 1005 for n in range(6)}
