"""Counters and histograms, behind a small collector protocol.

``JOBS["METRICS_COLLECTOR"]`` names the collector class (in-memory by default, ``None`` to
disable); a Prometheus collector ships in :mod:`django_jobs.contrib.prometheus` (extra
``prometheus``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from functools import lru_cache
from typing import Any, Protocol

from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from . import conf

COUNTERS = (
    "jobs_fetched",
    "jobs_succeeded",
    "jobs_failed",
    "jobs_requeued",
    "jobs_failed_permanently",
    "jobs_skipped_idempotent",
    "jobs_rejected_signature",
    "jobs_rejected_payload",
    "jobs_rejected_handler",
    "jobs_reaped",
    "jobs_reap_errors",
    "jobs_lease_lost",
    "jobs_dlq_failed",
    "jobs_signal_errors",
    "jobs_history_errors",
    "jobs_scheduled",
    "jobs_aborted",
    "jobs_dependents_resolved",
    "jobs_failures_recorded_late",
    "jobs_backend_errors",
)
HISTOGRAMS = ("jobs_exec_seconds", "jobs_wait_seconds", "jobs_retry_delay_seconds", "jobs_limit_wait_seconds")


class MetricsCollector(Protocol):
    def increment(self, name: str, value: float = 1, **labels: str) -> None: ...
    def observe(self, name: str, value: float, **labels: str) -> None: ...
    def snapshot(self) -> dict[str, Any]: ...


def _key(name: str, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    items = tuple(labels.items())
    return name, items if len(items) < 2 else tuple(sorted(items))


class InMemoryMetricsCollector:
    """Per-process counters and histogram summaries (count, sum, max); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[Any, float] = defaultdict(float)
        self._histograms: dict[Any, list[float]] = {}

    def increment(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, tuple(labels.items())) if len(labels) < 2 else _key(name, labels)  # one label: in order
        with self._lock:
            self._counters[key] += value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(labels.items())) if len(labels) < 2 else _key(name, labels)
        with self._lock:
            summary = self._histograms.setdefault(key, [0, 0.0, 0.0])
            summary[0] += 1
            summary[1] += value
            summary[2] = max(summary[2], value)

    def get(self, name: str, **labels: str) -> float:
        """A counter's value (summed over every label set when ``labels`` is empty), or a
        histogram's observation count."""
        with self._lock:
            if labels:
                key = _key(name, labels)
                return self._counters.get(key, self._histograms.get(key, [0])[0])
            total = sum(v for (n, _), v in self._counters.items() if n == name)
            return total or sum(h[0] for (n, _), h in self._histograms.items() if n == name)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"counters": [], "histograms": []}
            for (name, labels), value in sorted(self._counters.items()):
                out["counters"].append({"name": name, "labels": dict(labels), "value": value})
            for (name, labels), (count, total, peak) in sorted(self._histograms.items()):
                out["histograms"].append(
                    {"name": name, "labels": dict(labels), "count": count, "sum": total, "max": peak}
                )
            return out

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._histograms.clear()


class NullCollector:
    """Used when ``METRICS_COLLECTOR`` is ``None``."""

    def increment(self, name: str, value: float = 1, **labels: str) -> None:
        pass

    def observe(self, name: str, value: float, **labels: str) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"counters": [], "histograms": []}


@lru_cache(maxsize=4)
def _build(path: str | None) -> MetricsCollector:
    return NullCollector() if path is None else import_string(path)()


def get_collector() -> MetricsCollector:
    """The process-wide collector named by ``JOBS["METRICS_COLLECTOR"]``."""
    return _build(conf.get("METRICS_COLLECTOR"))


def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting == "JOBS":
        _build.cache_clear()


setting_changed.connect(_on_setting_changed)
