"""One /metrics for several models: each model's series, labelled with its name.

Each model's ``Worker`` keeps its own ``Metrics`` (its own registry, as when it ran alone); the
fleet's registry collects them all and adds ``model="NAME"`` to every sample, so one family
holds every model's series. The process's own series (``process_*``, ``python_*``) are the
same in each and are given once, without the label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["FleetMetrics"]

_PROCESS = ("process_", "python_")


class _ModelLabelled(Collector):
    def __init__(self, sources: Callable[[], Mapping[str, CollectorRegistry]]) -> None:
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for model, registry in self._sources().items():
            for family in registry.collect():
                if family.name.startswith(_PROCESS):
                    families.setdefault(family.name, family)
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for sample in family.samples:
                    merged.add_sample(
                        sample.name,
                        {**sample.labels, "model": model},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
        return list(families.values())


class FleetMetrics:
    """What ``MetricsServer`` serves for a fleet: a registry over the models' registries."""

    def __init__(self, sources: Callable[[], Mapping[str, CollectorRegistry]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ModelLabelled(sources))
