"""The worker's counters and histograms, in ``prometheus_client`` metrics.

In multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set in the environment before the process
starts) ``prometheus_client`` writes every value to a file per process in that directory, which
:func:`~django_jobs.contrib.prometheus.metrics_view` merges: nothing here differs between the modes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import prometheus_client

logger = logging.getLogger(__name__)

# The metrics created in each registry, shared by every collector counting into it: a second
# collector on the same registry (built again after a settings change) reuses them instead of
# registering the same names twice.
_created: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
# Histograms whose values outgrow Prometheus' default buckets (which end at 10 s): a start held
# back by a limit waits up to the lease timeout (parked) or as long as its rate says.
BUCKETS: dict[str, tuple[float, ...]] = {
    "jobs_limit_wait_seconds": (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 21600, 86400),
}


class PrometheusCollector:
    """Creates each metric on first use, in ``registry`` (the default registry when ``None``).

    Counters are exported as ``<name>_total``, histograms with Prometheus' default buckets
    (:data:`BUCKETS` where those are too short); the
    label names are those of the first use (``queue`` for every worker metric). A metric that
    cannot be updated is logged, never raised: these calls sit in the worker's path.
    """

    def __init__(self, registry: Any = None) -> None:
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        with _lock:
            self._metrics = _created.setdefault(self.registry, {})
        self._failed: set[str] = set()

    def _metric(self, kind: Any, name: str, labels: dict[str, str]) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            with _lock:
                metric = self._metrics.get(name)
                if metric is None:
                    extra = {"buckets": BUCKETS[name]} if name in BUCKETS else {}
                    description = f"django-jobs {name.replace('_', ' ')}"
                    metric = kind(name, description, sorted(labels), registry=self.registry, **extra)
                    self._metrics[name] = metric
        return metric.labels(**labels) if labels else metric

    def _update(self, kind: Any, name: str, labels: dict[str, str], method: str, value: float) -> None:
        try:
            getattr(self._metric(kind, name, labels), method)(value)
        except Exception:
            if name not in self._failed:  # once per metric: a broken directory fails every call
                self._failed.add(name)
                logger.exception("django-jobs: Prometheus metric %s could not be updated", name)

    def increment(self, name: str, value: float = 1, **labels: str) -> None:
        """Add ``value`` to the counter ``name``."""
        self._update(prometheus_client.Counter, name, labels, "inc", value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record ``value`` in the histogram ``name``."""
        self._update(prometheus_client.Histogram, name, labels, "observe", value)

    def snapshot(self) -> dict[str, Any]:
        """Current samples of this process's metrics: ``{sample name: [(labels, value), ...]}``."""
        out: dict[str, Any] = {}
        for metric in list(self._metrics.values()):
            for family in metric.collect():
                for sample in family.samples:
                    out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return out
