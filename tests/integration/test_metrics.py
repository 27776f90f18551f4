"""Metrics: every counter the database backend can produce moves when it should."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from django_jobs import Jobs
from django_jobs.dead_letter import DeadLetterQueue
from django_jobs.metrics import COUNTERS, HISTOGRAMS, InMemoryMetricsCollector, NullCollector, get_collector
from django_jobs.models import Job
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.api_support import (
    alias,
    counter,
    drain,
    jobs_settings,
    row,
    runs,
)
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


def counters() -> dict[str, float]:
    """Every counter, summed over labels (zeros included, so a whole picture can be compared)."""
    return {name: counter(name) for name in COUNTERS}


def moved(before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in counters().items() if value != before[name]}


def test_documented_counter_and_histogram_names_are_known():
    # The names docs/metrics.md promises.
    documented = {
        "jobs_fetched",
        "jobs_succeeded",
        "jobs_failed",
        "jobs_requeued",
        "jobs_failed_permanently",
        "jobs_skipped_idempotent",
        "jobs_rejected_signature",
        "jobs_rejected_payload",
        "jobs_reaped",
        "jobs_lease_lost",
        "jobs_dlq_failed",
    }
    assert documented <= set(COUNTERS)
    assert {"jobs_exec_seconds", "jobs_wait_seconds", "jobs_retry_delay_seconds", "jobs_limit_wait_seconds"} == set(
        HISTOGRAMS
    )
    assert isinstance(get_collector(), InMemoryMetricsCollector)


def test_success_counts_fetched_and_succeeded_and_observes_timings(backend):
    scripted.using(backend=backend).dispatch(action="ok")
    before = counters()
    assert QueueWorker(backend).process_once().status == "acked"
    assert moved(before) == {"jobs_fetched": 1, "jobs_succeeded": 1}
    collector = get_collector()
    assert collector.get("jobs_exec_seconds", queue="default") == 1  # one observation each
    assert collector.get("jobs_wait_seconds", queue="default") == 1
    assert collector.get("jobs_retry_delay_seconds") == 0
    [exec_hist] = [h for h in collector.snapshot()["histograms"] if h["name"] == "jobs_exec_seconds"]
    assert exec_hist["labels"] == {"queue": "default"} and exec_hist["count"] == 1 and exec_hist["sum"] >= 0


def test_an_empty_fetch_counts_nothing(backend):
    before = counters()
    assert QueueWorker(backend).process_once().status == "empty"
    assert moved(before) == {}


def test_failure_then_permanent_failure(backend):
    scripted.using(backend=backend, max_retries=1).dispatch(action="raise")
    worker = QueueWorker(backend)
    before = counters()
    assert worker.process_once().status == "requeued"
    assert moved(before) == {"jobs_fetched": 1, "jobs_failed": 1, "jobs_requeued": 1}
    assert get_collector().get("jobs_retry_delay_seconds", queue="default") == 1
    before = counters()
    assert worker.process_once().status == "dead-lettered"
    assert moved(before) == {"jobs_fetched": 1, "jobs_failed": 1, "jobs_failed_permanently": 1}
    assert get_collector().get("jobs_exec_seconds", queue="default") == 2


def test_counters_are_labelled_with_the_queue(backend):
    scripted.using(backend=backend, queue="emails").dispatch(action="ok")
    scripted.using(backend=backend, queue="emails").dispatch(action="raise")
    drain(QueueWorker(backend, ["emails"]))
    collector = get_collector()
    assert collector.get("jobs_fetched", queue="emails") == 2
    assert collector.get("jobs_succeeded", queue="emails") == 1
    assert collector.get("jobs_failed_permanently", queue="emails") == 1
    assert collector.get("jobs_fetched", queue="default") == 0


def test_skipped_idempotent_is_counted(backend):
    for _ in range(2):
        scripted.using(backend=backend, idempotency_key="m-key").dispatch(action="ok")
    worker = QueueWorker(backend)
    worker.process_once()
    before = counters()
    assert worker.process_once().status == "skipped-idempotent"
    assert moved(before) == {"jobs_fetched": 1, "jobs_skipped_idempotent": 1}


def test_rejections_are_counted_by_reason(backend):
    forged = scripted.using(backend=backend).dispatch(action="ok", key="never")
    Job.objects.using(alias(backend)).filter(pk=forged).update(signature="f" * 64)
    garbled = scripted.using(backend=backend).dispatch(action="ok", key="never")
    Job.objects.using(alias(backend)).filter(pk=garbled).update(options=["not", "a", "dict"])
    Jobs.define("not.registered", {}).dispatch(backend=backend)
    before = counters()
    assert [r.status for r in drain(QueueWorker(backend))] == ["rejected"] * 3
    assert moved(before) == {
        "jobs_fetched": 3,
        "jobs_rejected_signature": 1,
        "jobs_rejected_payload": 1,
        "jobs_rejected_handler": 1,
    }
    assert runs("never") == 0


def test_reaped_leases_are_counted(backend):
    job_id = scripted.using(backend=backend, max_retries=1).dispatch(action="ok")
    lease = Jobs.backend(backend).fetch("default")  # a worker took it, then died
    assert lease is not None and lease.token == job_id
    Job.objects.using(alias(backend)).filter(pk=job_id).update(leased_until=timezone.now() - timedelta(seconds=5))
    before = counters()
    assert Reaper(backend, ["default"]).reap_once() == 1
    assert moved(before) == {"jobs_reaped": 1}
    assert get_collector().get("jobs_reaped", queue="default") == 1
    job = row(backend, job_id)
    assert (job.status, job.attempts) == ("pending", 1)  # the lost run counts


def test_a_settle_after_the_lease_was_lost_is_counted(backend):
    job_id = scripted.using(backend=backend).dispatch(action="ok", key="late")
    worker = QueueWorker(backend)
    lease = Jobs.backend(backend).fetch("default")
    # Meanwhile the lease was reaped and redelivered to another worker (new owner token).
    Job.objects.using(alias(backend)).filter(pk=job_id).update(owner_token="someone-else")
    before = counters()
    result = worker.process(lease)
    assert (result.status, result.job_id) == ("lease-lost", job_id)
    assert moved(before) == {"jobs_fetched": 1, "jobs_lease_lost": 1}
    assert runs("late") == 1
    # Fenced: the stale ack changed nothing.
    job = row(backend, job_id)
    assert (job.status, job.owner_token, job.attempts) == ("in_progress", "someone-else", 0)


def test_dead_letter_store_unconfigured_returns_false_and_counts():
    assert DeadLetterQueue().store({"a": 1}, "command", "boom", 3) is False
    assert counter("jobs_dlq_failed") == 1
    assert Job.objects.count() == 0


def test_dead_letter_store_configured_enqueues_onto_the_dead_letter_queue(backend):
    with jobs_settings(DEAD_LETTER_QUEUE="other"):
        assert DeadLetterQueue(backend).store({"order": 9}, "command", "card declined", 3) is True
        assert counter("jobs_dlq_failed") == 0
    [job] = Job.objects.using(alias(backend)).all()
    assert (job.queue, job.handler, job.payload, job.status) == ("other", "command", {"order": 9}, "pending")
    assert "card declined" in job.name and "3" in job.name


def test_dead_letter_store_push_failure_returns_false_and_counts():
    with jobs_settings(DEAD_LETTER_QUEUE="not-a-queue"):
        assert DeadLetterQueue().store({"a": 1}, "command", "boom", 1) is False
        assert get_collector().get("jobs_dlq_failed", queue="not-a-queue") == 1
    assert Job.objects.count() == 0


def test_metrics_collector_none_disables_metrics(backend):
    with jobs_settings(METRICS_COLLECTOR=None):
        collector = get_collector()
        assert isinstance(collector, NullCollector)
        scripted.using(backend=backend).dispatch(action="ok", key="quiet")
        scripted.using(backend=backend).dispatch(action="raise", key="quiet")
        statuses = [r.status for r in drain(QueueWorker(backend))]
        assert collector.snapshot() == {"counters": [], "histograms": []}
    assert statuses == ["acked", "dead-lettered"]  # jobs still run normally
    assert runs("quiet") == 2


def test_metrics_collector_dotted_path_is_used():
    with jobs_settings(METRICS_COLLECTOR="tests.integration.test_metrics.ListCollector"):
        collector = get_collector()
        assert isinstance(collector, ListCollector)
        scripted.dispatch(action="ok")
        QueueWorker("default").process_once()
    names = [name for kind, name, _ in collector.events if kind == "increment"]
    assert names == ["jobs_fetched", "jobs_succeeded"]
    assert all(labels == {"queue": "default"} for _, _, labels in collector.events)


class ListCollector:
    """A minimal third-party collector: the protocol is increment / observe / snapshot."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, str]]] = []

    def increment(self, name: str, value: float = 1, **labels: str) -> None:
        self.events.append(("increment", name, labels))

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.events.append(("observe", name, labels))

    def snapshot(self) -> dict:
        return {"events": list(self.events)}
