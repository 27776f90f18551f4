"""The exposition view: mount ``metrics_view`` in a URLconf and point Prometheus at it."""

from __future__ import annotations

import os
from typing import Any

from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from .queues import QueueCollector


def metrics_registry() -> CollectorRegistry:
    """A fresh registry of what the view serves: the queue gauges, and the counters and
    histograms of every process writing to ``PROMETHEUS_MULTIPROC_DIR`` when it is set (this
    process's default registry otherwise)."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # registers itself
    else:
        registry.register(REGISTRY)
    registry.register(QueueCollector())
    return registry


def metrics_view(request: Any) -> HttpResponse:
    """The Prometheus text exposition (format 0.0.4). Open to anyone who can reach it: mount it
    on a path only Prometheus can reach, or behind your own access control."""
    return HttpResponse(generate_latest(metrics_registry()), content_type=CONTENT_TYPE_PLAIN_0_0_4)
