"""The `model_name` label vLLM puts on every series, added where a registry is exposed.

A service's metrics live in a registry of their own; `Exposed` wraps it as the registry that
/metrics renders, copying each sample with `model_name` set (none until the name is known:
a scheduler learns it from its worker). One place, so no metric can be declared without it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

MODEL_LABEL = "model_name"


class Exposed(Collector):
    def __init__(self, inner: CollectorRegistry, model_name: str | None = None) -> None:
        self.inner = inner
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self):
        for family in self.inner.collect():
            if self.model_name is None:
                yield family
                continue
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                s._replace(labels={MODEL_LABEL: self.model_name, **s.labels}) for s in family.samples
            ]
            yield labelled
