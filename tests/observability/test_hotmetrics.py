"""The request path's lock-free counters and histograms read as prometheus_client's would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_under_multiprocess_mode_the_request_path_uses_prometheus_client_metrics(
    tmp_path: Path,
) -> None:
    """prometheus_client's multiprocess mode aggregates only its own metrics (files per
    process): with PROMETHEUS_MULTIPROC_DIR set, the request path counts through them."""
    code = (
        "from prometheus_client import CollectorRegistry, Counter, multiprocess\n"
        "from spendguard import metrics\n"
        "from spendguard.engine.decision import Verdict\n"
        "from spendguard.engine.telemetry import decided\n"
        "assert isinstance(metrics.DECISIONS, Counter)\n"
        "decided(Verdict.ALLOW, True, None, False, None)\n"
        "metrics.PREFLIGHT_SECONDS.observe(0.001)\n"
        "class Recorder:\n"
        "    pending = 3\n"
        "recorder = Recorder()\n"
        "metrics.track_pending(recorder)\n"
        "metrics.pending_changed()  # what the record writer does after each write\n"
        "registry = CollectorRegistry()\n"
        "multiprocess.MultiProcessCollector(registry)\n"
        "labels = {'outcome': 'allowed', 'kind': 'limited', 'period': 'none'}\n"
        "print(registry.get_sample_value('spendguard_decisions_total', labels))\n"
        "call = {'call': 'preflight'}\n"
        "print(registry.get_sample_value('spendguard_store_seconds_count', call))\n"
        "print(registry.get_sample_value('spendguard_records_pending'))\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.0", "1.0", "3.0"]
