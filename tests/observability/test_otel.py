"""The otel extra: a span per preflight and postflight when SPENDGUARD_OTEL is on, nothing at
all when it is off or opentelemetry-api is missing. Spans are read with the SDK's in-memory
exporter (the SDK is in the test extra for this only)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spendguard import Settings
from spendguard.clock import utcnow
from spendguard.engine.guard import SpendGuard
from spendguard.limits import Period
from tests.support import Gateway

pytestmark = pytest.mark.anyio

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (set once: OpenTelemetry refuses a second), emptied."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def attributes(exporter: InMemorySpanExporter, name: str) -> list[dict[str, Any]]:
    return [dict(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == name]


async def test_spans_carry_outcome_limit_store_and_cost(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with Gateway(tmp_path, utcnow, otel=True) as gw:
        await gw.policy(Period.DAY, 20)
        statuses = [(await gw.post(x_in=10, x_out=5)).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    pre = attributes(spans, "spendguard.preflight")
    assert [(a["spendguard.outcome"], a["spendguard.limit.kind"]) for a in pre] == [
        ("allowed", "limited"),
        ("allowed", "limited"),
        ("denied", "api_key"),
    ]
    assert pre[2]["spendguard.limit.period"] == "day"
    assert {a["spendguard.store"] for a in pre} == {"memory"}
    post = attributes(spans, "spendguard.postflight")
    assert [a["spendguard.cost_micros"] for a in post] == [15, 15]
    assert post[0]["spendguard.output_tokens"] == 5 and post[0]["spendguard.charged"] is True
    # No identity in any attribute: no team, no key.
    values = {str(v) for a in pre + post for v in a.values()}
    assert not values & {"acme", "alpha"}


async def test_an_error_decision_marks_its_span(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    from spendguard.errors import StoreUnavailable

    async with Gateway(tmp_path, utcnow, otel=True) as gw:

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable("down")

        gw.store.inner.preflight = down
        assert (await gw.post()).status_code == 503
    (span,) = [s for s in spans.get_finished_spans() if s.name == "spendguard.preflight"]
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.attributes is not None and span.attributes["spendguard.limit.kind"] == "store"


async def test_off_by_default_nothing_is_wrapped_and_no_span_is_made(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with Gateway(tmp_path, utcnow) as gw:
        assert "preflight" not in vars(gw.guard)  # the class's own method: no wrapper at all
        assert (await gw.post()).status_code == 200
    assert spans.get_finished_spans() == ()


def test_on_without_opentelemetry_installed_warns_and_wraps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import fails
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'l.db'}", otel=True)
    guard = SpendGuard(settings)
    assert "preflight" not in vars(guard) and "postflight" not in vars(guard)
    assert "opentelemetry-api is not installed" in caplog.text
