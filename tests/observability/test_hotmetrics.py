"""The request path's lock-free counters and histograms read as prometheus_client's would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from spendguard.hotmetrics import HotCounter, HotHistogram


def exposition(*families: HotCounter | HotHistogram) -> str:
    class One:
        def collect(self) -> object:
            return [f.collect() for f in families]

    registry = CollectorRegistry()
    registry.register(One())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_a_histogram_counts_each_value_in_its_le_bucket_cumulated_at_scrape() -> None:
    h = HotHistogram("t_seconds", "help", ["call"], buckets=(0.1, 1, 0.5), export=False)
    child = h.labels("pre")
    for v in (0.05, 0.1, 0.3, 0.5, 2.0):
        child.observe(v)
    text = exposition(h)
    assert 't_seconds_bucket{call="pre",le="0.1"} 2.0' in text  # le is inclusive
    assert 't_seconds_bucket{call="pre",le="0.5"} 4.0' in text
    assert 't_seconds_bucket{call="pre",le="1.0"} 4.0' in text
    assert 't_seconds_bucket{call="pre",le="+Inf"} 5.0' in text
    assert 't_seconds_count{call="pre"} 5.0' in text
    assert 't_seconds_sum{call="pre"} 2.95' in text


def test_a_counter_is_exposed_with_total_and_its_pre_bound_series_at_zero() -> None:
    c = HotCounter("t_things_total", "help", ["kind"], export=False)
    c.labels("a").inc(3)
    c.labels("b")
    plain = HotCounter("t_plain_total", "help", export=False)
    plain.inc(2.5)
    text = exposition(c, plain)
    assert 't_things_total{kind="a"} 3.0' in text
    assert 't_things_total{kind="b"} 0.0' in text
    assert "t_plain_total 2.5" in text
    assert c.labels("a") is c.labels("a")  # one child per label set


def test_the_wrong_number_of_labels_is_refused() -> None:
    c = HotCounter("t_x_total", "help", ["kind"], export=False)
    with pytest.raises(ValueError):
        c.labels("a", "b")
