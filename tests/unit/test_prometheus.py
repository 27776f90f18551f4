"""The Prometheus collector: the worker's counters and histograms land in a real registry."""

import pytest
from django.conf import settings
from django.test import override_settings

prometheus_client = pytest.importorskip("prometheus_client")

from django_jobs.contrib.prometheus import PrometheusCollector
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted


@pytest.mark.django_db
def test_worker_metrics_reach_a_prometheus_registry():
    registry = prometheus_client.CollectorRegistry()
    collector = PrometheusCollector(registry)
    scripted.dispatch(action="ok")
    scripted.using(max_retries=0).dispatch(action="raise")

    worker = QueueWorker("default", metrics=collector)
    assert [worker.process_once().status for _ in range(2)] == ["acked", "dead-lettered"]

    sample = registry.get_sample_value
    assert sample("jobs_succeeded_total", {"queue": "default"}) == 1
    assert sample("jobs_failed_permanently_total", {"queue": "default"}) == 1
    assert sample("jobs_fetched_total", {"queue": "default"}) == 2
    assert sample("jobs_exec_seconds_count", {"queue": "default"}) == 2
    assert "jobs_succeeded_total" in collector.snapshot()


def test_collector_is_selected_by_setting():
    from django_jobs.metrics import get_collector

    path = "django_jobs.contrib.prometheus.PrometheusCollector"
    with override_settings(JOBS={**settings.JOBS, "METRICS_COLLECTOR": path}):
        assert isinstance(get_collector(), PrometheusCollector)
