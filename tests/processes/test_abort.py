"""Aborting a running job in a real ``manage.py jobs_work`` on PostgreSQL: the worker's heartbeat
learns of the abort on its next beat and the job ends ``cancelled``, never retried, however it
is stopped: it checks ``context.aborted`` and returns; ``JobAborted`` interrupts its sleep after
``ABORT_GRACE``; or, stuck where no signal reaches it, its process is ended and replaced.

The handler is ``tests.testapp.jobs.abortable``; each run records a ``SideEffect`` row with the
pid of the process that ran it, so a test knows when the job runs and that it ran once.
"""

from __future__ import annotations

import uuid

import pytest

from django_jobs import Jobs
from django_jobs.models import Job, JobAttempt
from tests.procs import pid_alive, processes, wait_until, worker_env
from tests.testapp.models import SideEffect

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]
# A beat every 0.3 s, so the worker learns of an abort quickly.
LEASE = 0.9


def start_abortable(procs, mode: str, grace: float) -> tuple[str, str]:
    """A worker on the pg backend, and an ``abortable`` job (max_retries=3) it is running."""
    key = f"abort-{mode}-{uuid.uuid4().hex[:12]}"
    procs.worker("--backend", "pg", env=worker_env(LEASE, JOBS_TEST_ABORT_GRACE=str(grace)))
    job_id = Jobs.define("abortable", {"mode": mode, "key": key, "db": PG}).max_retries(3).dispatch(backend="pg")
    wait_until(lambda: SideEffect.objects.using(PG).filter(key=key).exists(), 30, f"the {mode} job to start")
    return job_id, key


def ended_cancelled(job_id: str, key: str, error_class: str) -> None:
    """The job ended cancelled with who asked, after one run, and was never run again."""
    row = Job.objects.using(PG).get(pk=job_id)
    assert (row.status, row.attempts, row.last_error) == ("cancelled", 1, "Aborted by boss (admin)")
    [attempt] = JobAttempt.objects.using(PG).filter(job_id=job_id)
    assert (attempt.attempt, attempt.outcome, attempt.worker_id, attempt.error_class) == (
        1,
        "cancelled",
        "admin:boss",
        error_class,
    )
    assert SideEffect.objects.using(PG).filter(key=key).count() == 1


def cancelled(job_id: str) -> bool:
    return Job.objects.using(PG).filter(pk=job_id, status="cancelled").exists()


def test_a_cooperative_job_sees_the_abort_and_returns_well_within_the_grace():
    with processes() as procs:
        # A long grace: the job can only have ended this soon by returning on its own.
        job_id, key = start_abortable(procs, "cooperative", grace=60)
        assert Jobs.abort(job_id, "admin:boss") == "aborting"
        wait_until(lambda: cancelled(job_id), 30, "the cooperative job to end cancelled", interval=0.1)
    ended_cancelled(job_id, key, error_class="")


def test_a_job_that_ignores_the_abort_is_interrupted_by_job_aborted_after_the_grace():
    with processes() as procs:
        job_id, key = start_abortable(procs, "sleep", grace=1)
        assert Jobs.abort(job_id, "admin:boss") == "aborting"
        wait_until(lambda: cancelled(job_id), 30, "the sleeping job to end cancelled", interval=0.1)
    ended_cancelled(job_id, key, error_class="django_jobs.exceptions.JobAborted")


@pytest.mark.slow
def test_a_job_no_signal_reaches_is_settled_and_its_process_replaced():
    with processes() as procs:
        job_id, key = start_abortable(procs, "masked", grace=1)
        assert Jobs.abort(job_id, "admin:boss") == "aborting"
        wait_until(lambda: cancelled(job_id), 30, "the stuck job to end cancelled", interval=0.1)
        [run] = SideEffect.objects.using(PG).filter(key=key)
        wait_until(lambda: not pid_alive(run.pid), 30, "the stuck worker process to end")
        worker = procs.started[0]
        wait_until(lambda: any("died with status 75" in line for line in worker.err), 30, "a replacement")
        assert worker.alive(), worker.output()
    ended_cancelled(job_id, key, error_class="django_jobs.exceptions.JobAborted")
