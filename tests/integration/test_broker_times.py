"""A broker keeps no enqueue time of its own; a job's id does (a UUIDv7 starts with the time it
was made, at dispatch). So a broker job's ``Job`` row (a failure, a kept result) shows when the
job was sent, not when the row was written; the queue wait is measured from the dispatch; and the
oldest ready job of a Redis queue has an age."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.utils import timezone

from django_jobs.ids import time_of
from django_jobs.metrics import InMemoryMetricsCollector
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["redis", "beanstalk"])
def broker(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue("redis_up" if request.param == "redis" else "beanstalk_up")
    return str(request.param)


def test_a_broker_jobs_row_shows_when_it_was_sent_not_when_it_failed(broker: str) -> None:
    job_id = scripted.using(backend=broker, max_retries=1, backoff={"strategy": "none"}).dispatch(
        action="raise", seconds=0
    )
    sent = timezone.now()
    time.sleep(0.05)  # the runs come later than the dispatch
    worker = QueueWorker(broker, metrics=InMemoryMetricsCollector())
    first_run = timezone.now()
    results = [worker.process_once() for _ in range(2)]

    assert [r.status for r in results] == ["requeued", "dead-lettered"]
    row = Job.objects.get(pk=job_id)
    assert row.created_at == time_of(job_id) and row.created_at <= sent < first_run <= row.finished_at
    assert worker.metrics.get("jobs_wait_seconds") == 2  # both runs: from the dispatch, then the retry's due time


def test_a_kept_results_row_shows_when_it_was_sent(redis_up: Any) -> None:
    job_id = scripted.using(backend="redis", keep_result=True).dispatch(action="ok")
    sent = timezone.now()
    time.sleep(0.05)
    assert QueueWorker("redis").process_once().status == "acked"

    row = Job.objects.get(pk=job_id)
    assert row.status == "completed" and row.created_at <= sent < row.finished_at


def test_the_oldest_ready_redis_job_has_an_age(redis_backend: Any) -> None:
    assert redis_backend.oldest_ready_age("default") is None  # nothing ready
    scripted.using(backend="redis").dispatch(action="ok")  # at once: no available_at of its own
    time.sleep(0.05)

    age = redis_backend.oldest_ready_age("default")
    assert age is not None and age > 0
