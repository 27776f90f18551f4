"""Cancelling pending jobs (``operations.cancel_jobs``, the admin's *Cancel* action and button),
running a cancelled job again (``retry_jobs``, ``jobs_retry``), purging cancelled rows
(``jobs_purge --status cancelled``) and how a cancelled task reads through ``django.tasks``, on
the database backend over SQLite and PostgreSQL."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from django_jobs import Jobs, history, operations
from django_jobs.models import Job, JobAttempt
from django_jobs.tasks import TaskResultStatus
from django_jobs.worker import QueueWorker
from tests.api_support import alias, drain, row, runs
from tests.testapp import tasks as t
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]

REASON = "Cancelled by boss in the admin"


def run(*args: str, stderr: StringIO | None = None) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=stderr or StringIO())
    return out.getvalue()


def cancel(backend: str, *job_ids: str) -> operations.CancelOutcome:
    return operations.cancel_jobs(Job.objects.using(alias(backend)).filter(pk__in=job_ids), REASON, worker="admin:boss")


def test_cancel_settles_pending_rows_and_leaves_the_others_alone(backend):
    done = scripted.using(backend=backend).dispatch(action="ok")
    assert QueueWorker(backend).process_once().job_id == done
    running = scripted.using(backend=backend).dispatch(action="ok")
    lease = Jobs.backend(backend).fetch("default")  # a worker holds it, in progress
    assert lease is not None and lease.token == running
    pending = scripted.using(backend=backend).dispatch(action="ok", key="c-pending")
    before = {job_id: row(backend, job_id) for job_id in (done, running)}

    outcome = cancel(backend, pending, done, running)

    assert [job.pk for job in outcome.jobs] == [pending]
    cancelled = row(backend, pending)
    assert (cancelled.status, cancelled.last_error, cancelled.attempts) == ("cancelled", REASON, 0)
    assert cancelled.finished_at is not None and cancelled.owner_token is None and cancelled.leased_until is None
    for job_id, was in before.items():
        now = row(backend, job_id)
        assert (now.status, now.owner_token, now.finished_at, now.last_error) == (
            was.status,
            was.owner_token,
            was.finished_at,
            was.last_error,
        )
    # Its history says who cancelled it, in place of the run it will not have.
    [attempt] = JobAttempt.objects.using(alias(backend)).filter(job_id=pending)
    assert (attempt.attempt, attempt.outcome, attempt.worker_id, attempt.error) == (
        1,
        "cancelled",
        "admin:boss",
        REASON,
    )
    assert attempt.started_at is None
    assert not JobAttempt.objects.using(alias(backend)).filter(job_id__in=[done, running]).exists()
    # No worker runs it; the one in progress still settles normally.
    Jobs.backend(backend).ack(lease)
    assert QueueWorker(backend).process_once().status == "empty"
    assert runs("c-pending", db="default") == 0
    assert row(backend, running).status == "completed"


def test_a_job_claimed_between_the_selection_and_the_update_is_not_cancelled(backend, monkeypatch):
    first = scripted.using(backend=backend).dispatch(action="ok")
    second = scripted.using(backend=backend).dispatch(action="ok")
    record = history.record
    claimed = []

    def claim_the_other_first(job_id: str, *args, **kwargs) -> None:
        # After one row is settled, before the other one's UPDATE: a worker claims the other.
        if not claimed:
            claimed.append(Jobs.backend(backend).fetch("default"))
        record(job_id, *args, **kwargs)

    monkeypatch.setattr(history, "record", claim_the_other_first)

    outcome = cancel(backend, first, second)

    [lease] = claimed
    [settled] = [job.pk for job in outcome.jobs]
    assert lease is not None and {lease.token, settled} == {first, second}
    assert row(backend, settled).status == "cancelled"
    taken = row(backend, lease.token)
    assert (taken.status, taken.owner_token, taken.last_error) == ("in_progress", lease.owner_token, "")
    assert not JobAttempt.objects.using(alias(backend)).filter(job_id=lease.token).exists()


def test_a_job_waiting_for_a_retry_is_cancelled_as_its_next_attempt(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="raise")
    assert QueueWorker(backend).process_once().status == "requeued"
    assert row(backend, job_id).status == "pending"

    assert [job.attempts for job in cancel(backend, job_id).jobs] == [1]

    attempts = JobAttempt.objects.using(alias(backend)).filter(job_id=job_id).order_by("id")
    assert [(a.attempt, a.outcome) for a in attempts] == [(1, "retrying"), (2, "cancelled")]


def test_a_cancelled_job_can_be_retried_and_runs(backend):
    job_id = scripted.using(backend=backend).dispatch(action="ok", key="c-again")
    cancel(backend, job_id)

    outcome = operations.retry_jobs(Job.objects.using(alias(backend)).filter(pk=job_id))

    assert outcome.retried == 1 and outcome.jobs[0].status == "cancelled"
    job = row(backend, job_id)
    assert (job.status, job.attempts, job.last_error, job.finished_at) == ("pending", 0, "", None)
    assert QueueWorker(backend).process_once().job_id == job_id
    assert runs("c-again") == 1 and row(backend, job_id).status == "completed"


def test_jobs_retry_runs_a_cancelled_id_again_and_names_one_it_cannot(backend):
    cancelled = scripted.using(backend=backend).dispatch(action="ok")
    pending = scripted.using(backend=backend).dispatch(action="ok")
    cancel(backend, cancelled)
    err = StringIO()

    assert run("jobs_retry", cancelled, pending, stderr=err) == "retried 1 job(s)\n"

    assert err.getvalue().splitlines() == [f"{pending}: not failed or cancelled (it is pending); left alone"]
    assert row(backend, cancelled).status == "pending"


def test_jobs_retry_all_failed_leaves_cancelled_jobs_alone():
    cancelled = scripted.dispatch(action="ok")
    cancel("default", cancelled)
    failed = scripted.using(max_retries=0).dispatch(action="raise")
    drain(QueueWorker("default"))

    assert run("jobs_retry", "--all-failed") == "retried 1 job(s)\n"

    assert (row("default", failed).status, row("default", cancelled).status) == ("pending", "cancelled")


def test_jobs_purge_status_cancelled_deletes_cancelled_rows_and_their_history(backend):
    cancelled = scripted.using(backend=backend).dispatch(action="ok")
    cancel(backend, cancelled)
    failed = scripted.using(backend=backend, max_retries=0).dispatch(action="raise")
    drain(QueueWorker(backend))
    jobs = Job.objects.using(alias(backend))

    assert run("jobs_purge", "--status", "cancelled", "--dry-run") == "would delete 1 cancelled job(s)\n"
    assert run("jobs_purge", "--status", "cancelled") == "deleted 1 cancelled job(s)\n"

    assert not jobs.filter(pk=cancelled).exists()
    assert not JobAttempt.objects.using(alias(backend)).filter(job_id=cancelled).exists()
    assert jobs.get(pk=failed).status == "failed"
    assert JobAttempt.objects.using(alias(backend)).filter(job_id=failed).count() == 1


def test_a_cancelled_task_reads_as_failed():
    result = t.add.enqueue(1, 2)
    cancel("default", result.id)

    read = t.add.get_result(result.id)

    assert read.status == TaskResultStatus.FAILED
    assert read.finished_at == row("default", result.id).finished_at
    assert QueueWorker("default").process_once().status == "empty"
