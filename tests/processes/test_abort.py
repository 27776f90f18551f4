"""Aborting a running job in a real ``manage.py jobs_work``, on PostgreSQL (the database backend)
and on Redis, with the default ``LEASE_TIMEOUT`` (a beat every 20 s): the worker's heartbeat
reads the abort flag about once a second between its beats, and the job ends ``cancelled``
within seconds, after one run, never retried, its attempt recorded under who asked, however it
is stopped:

- a cooperative job sees the abort and returns: a ``JOBS["HANDLERS"]`` handler through its
  ``context.aborted``, a ``@job`` function through ``django_jobs.current_job().aborted``;
- a job that never looks (it sleeps in a loop) is interrupted by ``JobAborted`` when
  ``ABORT_GRACE`` runs out after the heartbeat saw the flag; its worker process carries on
  with the next job;
- a job no signal reaches is settled and its process ended and replaced (PostgreSQL only).

The jobs are ``tests.testapp.jobs.abortable`` (the handler) and ``abortable_job`` (the
``@job``); each run records a ``SideEffect`` row with the pid of the process that ran it, so a
test knows when the job runs, that it ran once, and whether its process lives on. The tests
wait for the job's end at most 10 s (the stuck job, stopped 3 s later by design, 15 s): less
than the 20 s to the first beat, so only the reads of the flag between beats can have stopped
it that soon.
"""

from __future__ import annotations

import uuid

import pytest

from django_jobs import Jobs
from django_jobs.models import Job, JobAttempt
from tests.procs import Proc, Procs, pid_alive, processes, wait_until, worker_env
from tests.testapp.jobs import abortable_job, scripted
from tests.testapp.models import SideEffect

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]
# Far less than the 20 s between two beats of the default LEASE_TIMEOUT (60 s), far more than
# the second the heartbeat may take to see an abort plus the grace the tests give a job.
STOPPED_WITHIN = 10
ALARM = "still running after the abort grace"  # what JobAborted says when the grace ran out


@pytest.fixture(params=["pg", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        request.getfixturevalue("redis_up")
    return str(request.param)


def records(backend: str) -> str:
    """Where the job's row and attempt history are: the pg backend's own database; a Redis job's
    record (kept once it is cancelled) and history in the router's database."""
    return PG if backend == "pg" else "default"


def start(procs: Procs, backend: str, kind: str, mode: str, grace: float) -> tuple[Proc, str, str]:
    """A worker on ``backend`` and an ``abortable`` job (max_retries=3) it is running: the
    handler (``kind`` "handler") or the ``@job`` function ("@job")."""
    key = f"abort-{mode}-{uuid.uuid4().hex[:12]}"
    worker = procs.worker("--backend", backend, env=worker_env(JOBS_TEST_ABORT_GRACE=str(grace)))
    if kind == "handler":
        builder = Jobs.define("abortable", {"mode": mode, "key": key, "db": PG}).max_retries(3)
        job_id = builder.dispatch(backend=backend)
    else:
        job_id = abortable_job.using(backend=backend, max_retries=3).dispatch(mode=mode, key=key, db=PG)
    wait_until(lambda: SideEffect.objects.using(PG).filter(key=key).exists(), 30, f"the {mode} job to start")
    return worker, job_id, key


def cancelled(backend: str, job_id: str) -> bool:
    return Job.objects.using(records(backend)).filter(pk=job_id, status="cancelled").exists()


def ended_cancelled(backend: str, job_id: str, key: str, error_class: str) -> JobAttempt:
    """The job ended cancelled with who asked, after one run, and was never run again; its
    attempt (returned) is recorded under who asked."""
    row = Job.objects.using(records(backend)).get(pk=job_id)
    assert (row.status, row.attempts, row.backend) == ("cancelled", 1, backend)
    assert row.last_error.splitlines()[0] == "Aborted by boss (admin)"
    [attempt] = JobAttempt.objects.using(records(backend)).filter(job_id=job_id)
    assert (attempt.attempt, attempt.outcome, attempt.worker_id, attempt.error_class) == (
        1,
        "cancelled",
        "admin:boss",
        error_class,
    )
    assert SideEffect.objects.using(PG).filter(key=key).count() == 1
    return attempt


@pytest.mark.parametrize("kind", ["handler", "@job"])
def test_a_cooperative_job_sees_the_abort_within_a_second_and_returns(backend, kind):
    with processes() as procs:
        # A grace far beyond the wait: the job can only have ended by returning on its own.
        worker, job_id, key = start(procs, backend, kind, "cooperative", grace=120)
        assert Jobs.abort(job_id, "admin:boss") == "aborting"
        wait_until(lambda: cancelled(backend, job_id), STOPPED_WITHIN, "the cooperative job to end cancelled")
        # A broker's row is written as the job is settled, a moment before its line is printed.
        wait_until(lambda: worker.job_lines("cancelled"), 10, "the worker's cancelled line")
    ended_cancelled(backend, job_id, key, error_class="")


def test_a_job_that_never_looks_is_interrupted_by_job_aborted_when_the_grace_runs_out(backend):
    grace = 1.0
    with processes() as procs:
        worker, job_id, key = start(procs, backend, "@job", "sleep", grace=grace)
        assert Jobs.abort(job_id, "admin:boss") == "aborting"
        # Within the read of the flag (about 1 s) plus the grace; the wait allows a loaded machine more.
        wait_until(lambda: cancelled(backend, job_id), STOPPED_WITHIN, "the job to end cancelled")
        # Its own process stopped it (the alarm, within the grace): the hard limit, 2 s later,
        # would have ended that process.
        [run] = SideEffect.objects.using(PG).filter(key=key)
        assert pid_alive(run.pid) and not any("died with status" in line for line in worker.err), worker.output()
        after = f"after-{key}"
        scripted.using(backend=backend).dispatch(action="ok", key=after, db=PG)
        wait_until(lambda: SideEffect.objects.using(PG).filter(key=after, pid=run.pid).exists(), 30, "the next job")
    attempt = ended_cancelled(backend, job_id, key, error_class="django_jobs.exceptions.JobAborted")
    assert ALARM in attempt.error


@pytest.mark.slow
def test_a_job_no_signal_reaches_is_settled_and_its_process_replaced():
    with processes() as procs:
        worker, job_id, key = start(procs, "pg", "handler", "masked", grace=1)
        assert Jobs.abort(job_id, "admin:boss") == "aborting"
        # The read of the flag, the grace (1 s), then the hard limit's 2 s.
        wait_until(lambda: cancelled("pg", job_id), STOPPED_WITHIN + 5, "the stuck job to end cancelled")
        [run] = SideEffect.objects.using(PG).filter(key=key)
        wait_until(lambda: not pid_alive(run.pid), 30, "the stuck worker process to end")
        wait_until(lambda: any("died with status 75" in line for line in worker.err), 30, "a replacement")
        assert worker.alive(), worker.output()
    attempt = ended_cancelled("pg", job_id, key, error_class="django_jobs.exceptions.JobAborted")
    assert "was killed" in attempt.error
