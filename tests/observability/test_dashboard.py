"""The Grafana dashboard under examples/ and docs/metrics.md cannot drift from the metrics the
library registers: every query names only registered series with labels they have, and every
registered metric is documented."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import spendguard.metrics
from spendguard.engine.costing import Stage

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana-dashboard.json"
SERIES = re.compile(r"\b(spendguard_[a-z_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
BY = re.compile(r"\bby\s*\(([^)]*)\)")
# Labels Prometheus adds at scrape time, and the histogram bucket label.
SCRAPE_LABELS = {"job", "instance"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}


def registered() -> dict[str, set[str]]:
    """Every spendguard series name a scrape can show -> its label names (from the samples,
    and for a labelled metric with no child yet, from its declaration)."""
    declared: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):
        for family in getattr(collector, "families", None) or [collector]:  # the hot collector
            labelnames = getattr(family, "labelnames", None) or getattr(family, "_labelnames", ())
            declared[getattr(family, "_name", getattr(family, "name", ""))] = set(labelnames)
    series: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("spendguard_"):
            continue
        labels = declared.get(family.name, set())
        labels |= {k for sample in family.samples for k in sample.labels if k != "le"}
        for suffix in SUFFIXES.get(family.type, ("",)):
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def expressions() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_the_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable() -> None:
    data = dashboard()
    assert data["title"] and data["uid"] and isinstance(data["schemaVersion"], int)
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]
        for target in p["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'job=~"$job"' in target["expr"], target["expr"]


def checked(exprs: list[str]) -> set[str]:
    """The series ``exprs`` use, each checked to be registered with the labels it is given."""
    series = registered()
    used = set()
    for expr in exprs:
        found = SERIES.findall(expr)
        assert found, expr
        for name, selector in found:
            assert name in series, f"{name} is not a metric spendguard registers ({expr})"
            used.add(name)
            labels = {m[0] for m in MATCHER.findall(selector)}
            assert labels <= series[name] | SCRAPE_LABELS, (name, labels)
        for group in BY.findall(expr):
            wanted = {label.strip() for label in group.split(",") if label.strip()}
            assert any(wanted <= series[name] for name, _ in found), (wanted, expr)
    return used


def test_every_query_names_registered_series_with_labels_they_have() -> None:
    used = checked(expressions())
    # The panels the dashboard promises are there.
    for name in (
        "spendguard_decisions_total",
        "spendguard_spend_micros_total",
        "spendguard_tokens_total",
        "spendguard_store_seconds_bucket",
        "spendguard_records_pending",
        "spendguard_records_written_total",
        "spendguard_overspend_micros_total",
        "spendguard_default_priced_total",
        "spendguard_store_unavailable_total",
        "spendguard_budget_rejections_total",
        "spendguard_budget_used_total",
        "spendguard_alerts_total",
        "spendguard_alert_deliveries_total",
    ):
        assert name in used, name


def test_the_alerting_rules_name_registered_series() -> None:
    rules = yaml.safe_load((ROOT / "examples" / "prometheus-alerts.yml").read_text())
    exprs = [r["expr"] for group in rules["groups"] for r in group["rules"]]
    names = [r["alert"] for group in rules["groups"] for r in group["rules"]]
    assert len(names) == len(set(names)) >= 5
    used = checked(exprs)
    assert {"spendguard_alerts_total", "spendguard_alert_deliveries_total"} <= used


def test_label_values_in_queries_are_from_the_closed_sets() -> None:
    allowed = {
        "outcome": {
            spendguard.metrics.ALLOWED,
            spendguard.metrics.DENIED,
            spendguard.metrics.ERROR,
        },
        "call": set(spendguard.metrics.STORE_CALLS),
    }
    for expr in expressions():
        for label, op, val in MATCHER.findall(expr):
            if label in allowed and op == "=":
                assert val in allowed[label], (label, val, expr)


@pytest.mark.parametrize("doc", ["docs/metrics.md"])
def test_every_registered_metric_is_documented(doc: str) -> None:
    text = (ROOT / doc).read_text()
    # The names a scrape shows (a counter's with its _total), each a whole word on the page:
    # spendguard_budget_used alone does not document spendguard_budget_used_total.
    series = registered()
    names = {
        n.removesuffix("_bucket") for n in series if not n.endswith(("_created", "_count", "_sum"))
    }
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", text))
    assert not missing, missing
    # A counter named without its _total is a series no scrape shows.
    truncated = sorted({m for m, _ in SERIES.findall(text) if f"{m}_total" in series})
    assert not truncated, truncated


def test_help_texts_name_every_stage() -> None:
    """The HELP of the two per-stage counters names each stage value they are counted with."""
    helps = {
        family.name: family.documentation
        for family in REGISTRY.collect()
        if family.name in ("spendguard_unknown_model", "spendguard_default_priced")
    }
    stages = {stage.value for stage in Stage}
    # A default price never answers at admission: only the reject rule refuses there.
    expected = {
        "spendguard_unknown_model": stages,
        "spendguard_default_priced": stages - {"admission"},
    }
    for name, values in expected.items():
        missing = sorted(v for v in values if v not in helps[name])
        assert not missing, (name, missing)
