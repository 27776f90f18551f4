"""A Prometheus collector: ``JOBS["METRICS_COLLECTOR"] = "django_jobs.contrib.prometheus.PrometheusCollector"``.

Counters are exported as ``<name>_total`` and histograms with Prometheus' default buckets,
labelled by ``queue``. ``jobs_work`` runs several processes: set ``PROMETHEUS_MULTIPROC_DIR``
and expose them with ``prometheus_client.multiprocess.MultiProcessCollector`` (see docs/metrics.md).
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends import require

prometheus_client = require("prometheus_client", "prometheus")


class PrometheusCollector:
    """Creates each metric on first use, in ``registry`` (the default registry when ``None``)."""

    def __init__(self, registry: Any = None) -> None:
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _metric(self, kind: Any, name: str, labels: dict[str, str]) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            with self._lock:
                metric = self._metrics.get(name)
                if metric is None:
                    metric = kind(name, f"django-jobs {name.replace('_', ' ')}", sorted(labels), registry=self.registry)
                    self._metrics[name] = metric
        return metric.labels(**labels) if labels else metric

    def increment(self, name: str, value: float = 1, **labels: str) -> None:
        self._metric(prometheus_client.Counter, name, labels).inc(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._metric(prometheus_client.Histogram, name, labels).observe(value)

    def snapshot(self) -> dict[str, Any]:
        """Current samples of this collector's metrics: ``{sample name: [(labels, value), ...]}``."""
        out: dict[str, Any] = {}
        for metric in list(self._metrics.values()):
            for family in metric.collect():
                for sample in family.samples:
                    out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return out
