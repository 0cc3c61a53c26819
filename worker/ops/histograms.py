"""Histograms observed a batch at a time, exposed as prometheus_client's own would be: the
worker observes a few values per request, so a batch's values are bucketed under one lock
(``Histogram``), and the queue wait keeps one such series per priority class
(``ByClassHistogram``)."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["ByClassHistogram", "Histogram"]


class Histogram(Collector):
    """A histogram observed a batch at a time, exposed as prometheus_client's own would be.

    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets in Python for
    each value, and the worker observes two values per request. Here a batch's values are
    bucketed by bisection under one lock. (No ``_created`` sample: nothing reads it.)
    """

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = [float(b) for b in buckets]
        self._le = [*(floatToGoString(b) for b in buckets), "+Inf"]
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        """Count each value in the first bucket whose upper bound it does not exceed."""
        bounds, counts = self._bounds, self._counts
        with self._lock:
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1
                self._sum += value

    @property
    def sum(self) -> float:
        """The sum of every value observed."""
        with self._lock:
            return self._sum

    @property
    def count(self) -> int:
        """How many values were observed."""
        with self._lock:
            return sum(self._counts)

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation)]

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """The cumulative count per bucket (by ``le``) and the sum, as exposed."""
        with self._lock:
            cumulative = list(itertools.accumulate(self._counts))
            total = self._sum
        return list(zip(self._le, cumulative, strict=True)), total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], *self.snapshot())
        yield family


class ByClassHistogram(Collector):
    """``Histogram`` with one series per priority class (label ``class``): the queue wait of
    each class is what lanes are for (docs/protocol.md, "Lanes"). A batch's values come with
    their classes; a batch of one class (the usual case) costs one ``observe_many``."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name, self._documentation = name, documentation
        self._parts = {
            cls: Histogram(name, documentation, buckets, CollectorRegistry())
            for cls in ("high", "normal", "low")
        }
        registry.register(self)

    def observe_many(self, values: Sequence[float], classes: Sequence[str] = ()) -> None:
        """``values`` of the classes ``classes`` (one each; none given: all ``normal``)."""
        if not classes or all(c == classes[0] for c in classes):
            self._parts[classes[0] if classes else "normal"].observe_many(values)
            return
        for cls, part in self._parts.items():
            part.observe_many(v for v, c in zip(values, classes, strict=True) if c == cls)

    @property
    def count(self) -> int:
        return sum(part.count for part in self._parts.values())

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=["class"])]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=["class"])
        for cls, part in self._parts.items():
            family.add_metric([cls], *part.snapshot())
        yield family
