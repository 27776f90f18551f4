"""Gauges read when Prometheus scrapes: queue depth, oldest ready job, backends up, live workers."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from prometheus_client.core import GaugeMetricFamily

from ... import conf
from ...backends import get_backend
from ...models import Worker
from ...operations import stats

logger = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

STATES = ("pending", "delayed", "in_progress", "failed", "waiting")


def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
    return (
        GaugeMetricFamily(
            "jobs_queue_depth", "Jobs of a queue by state, read from its backend.", labels=["backend", "queue", "state"]
        ),
        GaugeMetricFamily(
            "jobs_backend_up", "1 when every queue of the backend could be read, 0 otherwise.", labels=["backend"]
        ),
        GaugeMetricFamily(
            "jobs_queue_oldest_ready_seconds",
            "Seconds the oldest job ready to run has waited since it became ready.",
            labels=["backend", "queue"],
        ),
        GaugeMetricFamily(
            "jobs_workers_alive", "Worker processes that have reported within Worker.DEAD_AFTER.", labels=["backend"]
        ),
    )


class QueueCollector:
    """A ``prometheus_client`` custom collector: every figure is read at scrape time.

    A part that cannot be read (a backend's oldest job, the ``Worker`` table) is logged and left
    out; an unreachable backend gives ``jobs_backend_up 0``. The scrape itself never fails.
    """

    def describe(self) -> tuple[GaugeMetricFamily, ...]:
        """The families without samples: registering on an auto-describing registry reads nothing."""
        return _families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Read the backends and the ``Worker`` table now."""
        depth, up, oldest, workers = _families()
        readable = _guarded("queue depth", _add_depth, depth, up) or []
        for backend, queue in readable:
            _guarded(f"oldest ready age of {backend}/{queue}", _add_oldest, oldest, backend, queue)
        _guarded("live workers", _add_workers, workers)
        yield from (depth, up, oldest, workers)


def _guarded(part: str, read: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    try:
        return read(*args, **kwargs)
    except Exception:
        logger.exception("django-jobs metrics: %s could not be read", part)
        return None


def _add_depth(depth: GaugeMetricFamily, up: GaugeMetricFamily) -> list[tuple[str, str]]:
    """Depth samples of every queue that could be read (returned), ``jobs_backend_up`` per backend."""
    reachable: dict[str, bool] = {}
    readable = []
    for row in stats():
        backend, queue = row["backend"], row["queue"]
        if "error" in row:
            logger.warning("django-jobs metrics: backend %s, queue %s: %s", backend, queue, row["error"])
            reachable[backend] = False
            continue
        reachable.setdefault(backend, True)
        readable.append((backend, queue))
        for state in STATES:
            if state in row:
                depth.add_metric([backend, queue, state], row[state])
    for backend, ok in reachable.items():
        up.add_metric([backend], 1 if ok else 0)
    return readable


def _add_oldest(oldest: GaugeMetricFamily, backend: str, queue: str) -> None:
    age = get_backend(backend).oldest_ready_age(queue)
    if age is not None:
        oldest.add_metric([backend, queue], age)


def _add_workers(workers: GaugeMetricFamily) -> None:
    """Live worker processes per backend; 0 for a configured backend that has none."""
    counts = Counter(Worker.objects.alive().values_list("backend", flat=True))
    for backend in sorted({*(conf.get("BACKENDS") or {}), *counts}):
        workers.add_metric([backend], counts[backend])
