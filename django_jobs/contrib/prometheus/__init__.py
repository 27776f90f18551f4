"""Prometheus support (extra ``prometheus``): the worker's counters and histograms, queue gauges
read at scrape time, and a view that serves them.

- ``JOBS["METRICS_COLLECTOR"] = "django_jobs.contrib.prometheus.PrometheusCollector"`` makes
  workers count into ``prometheus_client``;
- :func:`metrics_view`, mounted in a URLconf, serves the text exposition: the figures of every
  ``jobs_work`` process when ``PROMETHEUS_MULTIPROC_DIR`` is set, and the :class:`QueueCollector`
  gauges (see docs/metrics.md).
"""

from ...backends import require

# First, so that a missing prometheus_client is reported with the extra that installs it.
require("prometheus_client", "prometheus")

from .collector import PrometheusCollector
from .queues import QueueCollector
from .view import metrics_registry, metrics_view

__all__ = ["PrometheusCollector", "QueueCollector", "metrics_registry", "metrics_view"]
