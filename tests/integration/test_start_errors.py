"""Only a handler call is a run: an error between a job's claim and its start hands the job back
uncounted, on PostgreSQL with real connection cuts.

Each test cuts the worker's own database session (``pg_terminate_backend`` from another
connection: the server closes it, as a failover or a pooler would) just before one step between
the claim and the handler: the lease check, the limits' acquire, the parent result's read. That
step fails with the driver's real error. The job is deferred, not counted as a run (a
``max_retries=0`` job is not failed), the error is logged and counted in
``jobs_backend_errors``, and the next delivery runs the job once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings
from django.utils import timezone

from django_jobs import chain
from django_jobs.backends.base import QueueBackend
from django_jobs.metrics import InMemoryMetricsCollector
from django_jobs.models import Job, JobStatus
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import flow_step, scripted
from tests.testapp.models import SideEffect

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]


def cut_session() -> None:
    """Terminate this thread's session of the ``postgres`` alias from another connection."""
    pid = connections[PG].connection.info.backend_pid
    db = settings.DATABASES[PG]
    with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"], autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(%s)", [pid])


def cut_before(backend: QueueBackend, method: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Cut the session the first time ``backend.<method>`` is called, just before it runs."""
    real: Callable[..., Any] = getattr(backend, method)
    cuts: list[str] = []

    def cut_then_call(*args: Any, **kwargs: Any) -> Any:
        if not cuts:
            cuts.append(method)
            cut_session()
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, method, cut_then_call)
    return cuts


def row(job_id: str) -> tuple[str, int]:
    job = Job.objects.using(PG).get(pk=job_id)
    return job.status, job.attempts


def runs(key: str) -> int:
    return SideEffect.objects.using(PG).filter(key=key).count()


@pytest.fixture
def worker() -> QueueWorker:
    return QueueWorker("pg", metrics=InMemoryMetricsCollector(), busy_delay=0)


def assert_handed_back_then_run_once(worker: QueueWorker, job_id: str, key: str, cuts: list[str], caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="django_jobs.worker"):
        first = worker.process_once()
    assert cuts, "the cut was never made: the step under test did not run"
    assert (first.status, first.label, first.attempt) == ("requeued", "deferred", 0), first.error
    assert row(job_id) == (JobStatus.PENDING, 0), "a job that never started counts no run"
    assert runs(key) == 0
    assert worker.metrics.get("jobs_backend_errors") == 1
    assert any("error before it started" in r.getMessage() for r in caplog.records), caplog.text

    second = worker.process_once()
    assert (second.status, second.attempt) == ("acked", 1), second.error
    assert row(job_id) == (JobStatus.COMPLETED, 1)
    assert runs(key) == 1


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def test_a_cut_during_the_lease_check_hands_the_job_back_uncounted(worker, monkeypatch, caplog):
    key = unique("lease-check")
    job_id = scripted.using(backend="pg", max_retries=0).dispatch(action="ok", key=key, db=PG)
    fetch = worker.backend.fetch

    def half_spent(queue: str) -> Any:  # the guards took half the lease: the start check extends it
        lease = fetch(queue)
        if lease is not None:
            lease.expires_at = timezone.now() + timedelta(seconds=1)
        return lease

    monkeypatch.setattr(worker.backend, "fetch", half_spent)
    cuts = cut_before(worker.backend, "extend", monkeypatch)

    assert_handed_back_then_run_once(worker, job_id, key, cuts, caplog)


def test_a_cut_during_the_limits_acquire_hands_the_job_back_uncounted(worker, monkeypatch, caplog):
    key = unique("limits")
    job_id = scripted.using(backend="pg", max_retries=0).dispatch(action="ok", key=key, db=PG)
    cuts = cut_before(worker.backend, "acquire", monkeypatch)

    with override_settings(JOBS={**settings.JOBS, "LIMITS": {"queue:default": {"concurrency": 2}}}):
        assert_handed_back_then_run_once(worker, job_id, key, cuts, caplog)


def test_a_cut_during_the_parent_result_read_hands_the_step_back_uncounted(worker, monkeypatch, caplog):
    key = unique("chain")
    first, second = chain(
        flow_step.using(backend="pg").prepare(None, key=f"{key}-1", db=PG),
        flow_step.using(backend="pg", max_retries=0).prepare(key=key, db=PG),
        pass_result=True,
    ).dispatch()
    assert worker.process_once().status == "acked"  # the first step: its result is stored
    cuts = cut_before(worker.backend, "stored_result", monkeypatch)

    assert_handed_back_then_run_once(worker, second, key, cuts, caplog)
    assert row(first) == (JobStatus.COMPLETED, 1)
