"""The Prometheus support: the worker's counters and histograms land in a real registry, and
``metrics_view`` serves them with the queue gauges, checked by parsing the exposition text."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client, override_settings
from django.urls import path
from django.utils import timezone

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from django_jobs.backends import get_backend
from django_jobs.contrib.prometheus import PrometheusCollector, metrics_view
from django_jobs.models import Worker
from django_jobs.worker import QueueWorker
from tests.servers import free_port
from tests.testapp.jobs import scripted

PROMETHEUS = "django_jobs.contrib.prometheus.PrometheusCollector"
TEST_BACKENDS = settings.JOBS["BACKENDS"]

# Mounted as a user would: the tests below serve this module as ROOT_URLCONF.
urlpatterns = [path("metrics", metrics_view)]

serve_metrics = override_settings(ROOT_URLCONF=__name__)


def jobs_on(*backends: str, **changes: object) -> override_settings:
    """The test settings with only these backends (so a scrape reads no other service)."""
    configured = {name: TEST_BACKENDS[name] for name in backends}
    return override_settings(JOBS={**settings.JOBS, "BACKENDS": configured, **changes})


def scrape() -> dict[str, dict[tuple[str, ...], float]]:
    """GET the mounted view and parse its text: ``{sample name: {label values: value}}``, the
    label values in the label names' alphabetical order."""
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            labels = tuple(value for _, value in sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def total(samples: dict[str, dict[tuple[str, ...], float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


# -- the collector -------------------------------------------------------------------------------


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

    with override_settings(JOBS={**settings.JOBS, "METRICS_COLLECTOR": PROMETHEUS}):
        assert isinstance(get_collector(), PrometheusCollector)


def test_collectors_on_one_registry_share_its_metrics():
    """A collector built again (after a settings change) counts on instead of registering twice."""
    registry = prometheus_client.CollectorRegistry()
    PrometheusCollector(registry).increment("jobs_succeeded", queue="q")
    PrometheusCollector(registry).increment("jobs_succeeded", queue="q")
    assert registry.get_sample_value("jobs_succeeded_total", {"queue": "q"}) == 2


def test_a_metric_that_cannot_be_updated_is_logged_once_never_raised(caplog):
    registry = prometheus_client.CollectorRegistry()
    collector = PrometheusCollector(registry)
    collector.increment("jobs_reaped", queue="q")
    for _ in range(3):
        collector.increment("jobs_reaped", signal="other label names")  # ValueError inside
    assert registry.get_sample_value("jobs_reaped_total", {"queue": "q"}) == 1
    logged = [r for r in caplog.records if "jobs_reaped could not be updated" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info


# -- the view ------------------------------------------------------------------------------------


@serve_metrics
@pytest.mark.django_db
def test_view_serves_the_worker_counters_and_the_queue_gauges():
    """Without PROMETHEUS_MULTIPROC_DIR the view serves this process's default registry."""
    with jobs_on("default", METRICS_COLLECTOR=PROMETHEUS):
        before = scrape()
        scripted.dispatch(action="ok")
        scripted.using(max_retries=0).dispatch(action="raise")
        worker = QueueWorker("default")
        assert [worker.process_once().status for _ in range(2)] == ["acked", "dead-lettered"]
        after = scrape()

    for name, moved in [
        ("jobs_succeeded_total", 1),
        ("jobs_failed_permanently_total", 1),
        ("jobs_fetched_total", 2),
        ("jobs_exec_seconds_count", 2),
    ]:
        assert total(after, name) - total(before, name) == moved, name
    assert after["jobs_queue_depth"][("default", "default", "failed")] == 1
    assert after["jobs_backend_up"] == {("default",): 1}


@serve_metrics
@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize(
    ("name", "service"),
    [("default", None), pytest.param("pg", "postgres_up", marks=pytest.mark.postgres), ("redis", "redis_up")],
)
def test_queue_depth_counts_the_jobs_waiting_on_the_backend(request, name, service, django_capture_on_commit_callbacks):
    if service:
        request.getfixturevalue(service)

    def dispatch(action: str = "ok", **options: object) -> None:
        # A broker receives the job when the test's transaction would commit.
        with django_capture_on_commit_callbacks(execute=True):
            scripted.using(backend=name, **options).dispatch(action=action)

    with jobs_on("default", name):
        dispatch("raise", max_retries=0)
        assert QueueWorker(name).process_once().status == "dead-lettered"
        for _ in range(3):
            dispatch()
        dispatch(delay=3600)
        dispatch(queue="emails")
        assert get_backend(name).fetch("default") is not None  # one in progress

        samples = scrape()

    depth = {labels: value for labels, value in samples["jobs_queue_depth"].items() if labels[0] == name}
    expected = {"default": (2, 1, 1, 1), "emails": (1, 0, 0, 0), "other": (0, 0, 0, 0)}
    for queue, counts in expected.items():
        states = {state: depth.get((name, queue, state)) for state in ("pending", "delayed", "in_progress", "failed")}
        assert tuple(states.values()) == counts, (queue, states)
    assert samples["jobs_backend_up"][(name,)] == 1


@serve_metrics
@pytest.mark.django_db
def test_an_unreachable_backend_is_down_and_the_scrape_still_succeeds(caplog):
    closed = {"ENGINE": "redis", "OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0", "PREFIX": "down"}}
    backends = {"default": TEST_BACKENDS["default"], "down": closed}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}):
        scripted.dispatch(action="ok")
        samples = scrape()

    assert samples["jobs_backend_up"] == {("default",): 1, ("down",): 0}
    assert {labels[0] for labels in samples["jobs_queue_depth"]} == {"default"}
    assert samples["jobs_queue_depth"][("default", "default", "pending")] == 1
    assert all(labels[0] == "default" for labels in samples.get("jobs_queue_oldest_ready_seconds", {}))
    assert any("backend down, queue default" in r.getMessage() for r in caplog.records)


@serve_metrics
@pytest.mark.django_db
def test_oldest_ready_age_is_exported_where_the_backend_knows_it(monkeypatch, caplog):
    """A known age is a sample, ``None`` is no sample, and a backend that fails is logged and
    left out while the rest of the scrape goes on."""

    def age(queue: str) -> float | None:
        if queue == "other":
            raise RuntimeError("cannot tell")
        return {"default": 42.5}.get(queue)

    with jobs_on("default"):
        monkeypatch.setattr(get_backend("default"), "oldest_ready_age", age)
        samples = scrape()

    assert samples["jobs_queue_oldest_ready_seconds"] == {("default", "default"): 42.5}
    assert samples["jobs_backend_up"] == {("default",): 1}
    assert any("oldest ready age of default/other" in r.getMessage() and r.exc_info for r in caplog.records)


@serve_metrics
@pytest.mark.django_db
def test_workers_alive_counts_live_worker_rows_per_backend():
    now = timezone.now()

    def worker(pid: int, backend: str, **fields: object) -> None:
        Worker.objects.create(id=f"host:{pid}:x", hostname="host", pid=pid, backend=backend, **fields)

    worker(1, "default")
    worker(2, "default", queues=["default", "emails"])
    worker(3, "default", stopped_at=now)
    worker(4, "default", last_seen=now - Worker.DEAD_AFTER - timedelta(seconds=1))
    worker(5, "gone")  # a backend no longer configured still has its live process counted
    with jobs_on("default", "sync"):
        samples = scrape()

    assert samples["jobs_workers_alive"] == {("default",): 2, ("gone",): 1, ("sync",): 0}
