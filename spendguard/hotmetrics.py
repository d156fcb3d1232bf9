"""Counters and histograms for the request path, exported through ``prometheus_client``.

A ``prometheus_client`` child takes a lock per ``inc`` or ``observe`` (about 1 µs and 2.5 µs on
a small cloud core): a handful per inference is several percent of spendguard's whole cost.
These are plain Python numbers updated in place (about 0.1 µs each), read when Prometheus
scrapes, by one collector in the default registry. Their children are pre-bound: a label set is
resolved once, at import.

They are meant for the event loop's thread, where the engine runs: increments from several
threads at once could lose a count (``+=`` is not atomic), never corrupt one. A scrape from
another thread reads each number whole.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Bucket i counts values <= bounds[i] (Prometheus' "le"); cumulated at scrape time.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    """A metric's name, help and label names; ``export=False`` keeps one out of the registry
    (a test's)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)


class HotCounter(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        export: bool = True,
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        if not self.labelnames:
            self._children[()] = CounterChild()
        if export:
            _COLLECTOR.families.append(self)

    def labels(self, *values: str) -> CounterChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}")
        return self._children.setdefault(tuple(values), CounterChild())

    def inc(self, amount: float = 1) -> None:
        self._children[()].inc(amount)

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        return family


class HotHistogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Iterable[float],
        export: bool = True,
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if not self.labelnames:
            self._children[()] = HistogramChild(self.bounds)
        if export:
            _COLLECTOR.families.append(self)

    def labels(self, *values: str) -> HistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}")
        return self._children.setdefault(tuple(values), HistogramChild(self.bounds))

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]
        for values, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for le, count in zip(les, counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(values, buckets, total)
        return family


class _Collector:
    def __init__(self) -> None:
        self.families: list[HotCounter | HotHistogram] = []

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.collect()

    def describe(self) -> list[Metric]:
        # Names only: the registry uses them to refuse a duplicate.
        return [
            CounterMetricFamily(f.name, f.documentation)
            if isinstance(f, HotCounter)
            else HistogramMetricFamily(f.name, f.documentation)
            for f in self.families
        ]


_COLLECTOR = _Collector()


def register() -> None:
    """Export the families defined so far in the default registry (once, after defining them:
    the registry learns their names then and refuses duplicates)."""
    REGISTRY.register(_COLLECTOR)
