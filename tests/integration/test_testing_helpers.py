"""django_jobs.testing.run_jobs, the sync backend's RAISE option, and ``jobs_work --once`` /
``--max`` run in the caller's process: what a project's own tests rely on.

Every test runs inside pytest-django's transaction (``django_db``), as a project's tests do.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from io import StringIO
from unittest import mock

import pytest
from django.core.management import call_command

from django_jobs import Jobs
from django_jobs.exceptions import BadSignature, HandlerNotAllowed, JobsError, UnknownQueue
from django_jobs.heartbeat import Heartbeat
from django_jobs.history import attempts_of
from django_jobs.locks import CacheLock
from django_jobs.models import Job
from django_jobs.pool import WorkerPool
from django_jobs.signals import job_succeeded
from django_jobs.testing import run_jobs
from tests.api_support import jobs_settings
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]

SINGLE_LOCK = f"django_jobs:single:{scripted.key}"


@dataclass(frozen=True)
class Engine:
    backend: str  # the JOBS["BACKENDS"] name in tests/settings.py
    db: str  # where its jobs' side effects and attempt history go


@pytest.fixture(
    params=[Engine("default", "default"), Engine("pg", "postgres"), Engine("redis", "default")],
    ids=["database-sqlite", "database-postgres", "redis"],
)
def engine(request: pytest.FixtureRequest) -> Engine:
    """The database engine on SQLite and PostgreSQL, and Redis (this session's key prefix)."""
    case: Engine = request.param
    if case.backend == "pg":
        request.getfixturevalue("postgres_up")
    if case.backend == "redis":
        request.getfixturevalue("redis_up")
    return case


@pytest.fixture
def send(engine: Engine, django_capture_on_commit_callbacks):
    """Dispatch a scripted job to ``engine`` as application code would, from inside the test's
    transaction (a non-database backend sends on commit: the capture runs that commit hook)."""

    def send(action: str = "ok", key: str | None = None, fail_times: int = 0, **options) -> str:
        with django_capture_on_commit_callbacks(execute=True):
            return scripted.using(backend=engine.backend, **options).dispatch(
                action=action, key=key, db=engine.db, fail_times=fail_times
            )

    return send


def ran(engine: Engine, key: str) -> list[int]:
    """The pids of the processes that ran the scripted job recording under ``key``."""
    return list(SideEffect.objects.using(engine.db).filter(key=key).values_list("pid", flat=True))


# -- run_jobs --------------------------------------------------------------------------------------


def test_run_jobs_runs_the_tests_own_jobs_in_its_process_without_threads_or_forks(engine, send):
    ids = [send(key=f"k{i}", priority=3 - i) for i in range(3)]
    with (
        mock.patch.object(threading.Thread, "start", side_effect=AssertionError("a thread was started")),
        mock.patch.object(Heartbeat, "start", side_effect=AssertionError("the heartbeat was started")),
        mock.patch.object(os, "fork", side_effect=AssertionError("a process was forked")),
    ):
        results = run_jobs(backend=engine.backend)
    assert [(r.status, r.job_id, r.attempt) for r in results] == [("acked", i, 1) for i in ids]
    # The jobs ran here, on the test's connection: their writes are in the test's transaction.
    assert [ran(engine, f"k{i}") for i in range(3)] == [[os.getpid()]] * 3
    assert run_jobs(backend=engine.backend) == []


def test_run_jobs_takes_the_queues_asked_for_in_their_order(engine, send):
    on_default, on_emails, on_other = send(key="d"), send(key="e", queue="emails"), send(key="o", queue="other")
    assert [r.job_id for r in run_jobs("emails", backend=engine.backend)] == [on_emails]
    assert [r.job_id for r in run_jobs(["other", "default"], backend=engine.backend)] == [on_other, on_default]
    send(key="d2")
    send(key="e2", queue="emails")
    assert sorted(r.queue for r in run_jobs(backend=engine.backend)) == ["default", "emails"]  # None: every queue


def test_run_jobs_stops_after_max_deliveries(engine, send):
    ids = [send(key=f"m{i}", priority=3 - i) for i in range(3)]
    assert [r.job_id for r in run_jobs(backend=engine.backend, max=2)] == ids[:2]
    assert ran(engine, "m2") == []
    assert [r.job_id for r in run_jobs(backend=engine.backend, max=5)] == ids[2:]


def test_a_retry_waits_for_its_backoff_unless_delayed_jobs_are_included(engine, send):
    job_id = send(
        "flaky",
        key="flaky",
        fail_times=1,
        max_retries=2,
        backoff={"strategy": "fixed", "base": 60, "jitter": False},
        keep_result=True,
    )
    [first] = run_jobs(backend=engine.backend)
    assert (first.status, first.attempt) == ("requeued", 1)
    assert isinstance(first.exception, RuntimeError)
    assert run_jobs(backend=engine.backend) == []  # due in a minute: not run now
    [second] = run_jobs(backend=engine.backend, include_delayed=True)
    assert (second.status, second.job_id, second.attempt) == ("acked", job_id, 2)
    history = [(a.attempt, a.outcome, a.error_class) for a in attempts_of(job_id, using=engine.db)]
    assert history == [(1, "retrying", "builtins.RuntimeError"), (2, "completed", "")]


def test_include_delayed_runs_delayed_jobs_in_the_order_they_fall_due(engine, send):
    late, soon = send(key="late", delay=300), send(key="soon", delay=100)
    ready = send(key="ready")
    assert [r.job_id for r in run_jobs(backend=engine.backend)] == [ready]
    assert [r.job_id for r in run_jobs(backend=engine.backend, include_delayed=True, max=1)] == [soon]
    # The clock jumped to the first due time, not past every delay: the other is still 200 s away.
    assert run_jobs(backend=engine.backend) == []
    assert [r.job_id for r in run_jobs(backend=engine.backend, include_delayed=True)] == [late]


def test_include_delayed_ends_when_the_only_job_left_is_held_back(engine, send):
    lock = CacheLock(SINGLE_LOCK, "another-delivery", 60)
    assert lock.acquire()
    job_id = send(key="single", single_instance=True)
    results = run_jobs(backend=engine.backend, include_delayed=True, max=50)
    assert 0 < len(results) < 50, "it ended by itself"
    assert {(r.status, r.job_id) for r in results} == {("requeued", job_id)}
    assert ran(engine, "single") == []
    lock.release()
    assert [r.status for r in run_jobs(backend=engine.backend, include_delayed=True)] == ["acked"]


def test_run_jobs_goes_through_the_pipeline_checks(engine, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        unknown = Jobs.define("shop.jobs.not_deployed").dispatch(engine.backend)
    [result] = run_jobs(backend=engine.backend)
    assert (result.status, result.job_id) == ("rejected", unknown)
    assert "HandlerNotAllowed" in (result.error or "")


def test_a_row_changed_after_signing_is_rejected_not_run():
    job_id = scripted.dispatch(action="ok", key="forged")
    Job.objects.filter(pk=job_id).update(payload={"args": [], "kwargs": {"action": "raise", "key": "forged"}})
    [result] = run_jobs()
    assert (result.status, result.job_id) == ("rejected", job_id)
    assert "BadSignature" in (result.error or "")
    assert not SideEffect.objects.filter(key="forged").exists()


def test_signals_are_sent_from_run_jobs(engine, send):
    seen = []

    def receiver(sender, envelope, attempt, result, **kwargs):
        seen.append((sender, envelope.id, attempt, result))

    job_succeeded.connect(receiver)
    try:
        job_id = send("ok", key="signal")
        run_jobs(backend=engine.backend)
    finally:
        job_succeeded.disconnect(receiver)
    assert seen == [(scripted, job_id, 1, "ok")]


def test_run_jobs_refuses_what_it_cannot_do():
    with pytest.raises(UnknownQueue, match="'emials'"):
        run_jobs("emials")
    with pytest.raises(ValueError, match="max"):
        run_jobs(max=-1)
    # The sync backend runs each job at dispatch: there is no delayed job to bring forward.
    assert run_jobs(backend="sync") == []
    with pytest.raises(JobsError, match="database or redis engine"):
        run_jobs(backend="sync", include_delayed=True)


# -- the sync backend's RAISE option ---------------------------------------------------------------

RAISING = {"ENGINE": "sync", "OPTIONS": {"RAISE": True}}


@pytest.fixture
def raising():
    from django.conf import settings

    with jobs_settings(BACKENDS={**settings.JOBS["BACKENDS"], "raising": RAISING}):
        yield Jobs.backend("raising")


def test_raise_re_raises_the_jobs_exception_and_still_records_the_failure(raising, django_capture_on_commit_callbacks):
    # Inside the test's transaction the dispatch runs on commit: the capture's exit raises.
    with pytest.raises(RuntimeError, match="scripted failure"), django_capture_on_commit_callbacks(execute=True):
        scripted.using(backend="raising", max_retries=3).dispatch(action="raise")
    result = raising.last_results[-1]
    assert result.status == "dead-lettered"
    failed = Job.objects.get(pk=result.job_id)
    assert (failed.status, failed.backend) == ("failed", "raising")


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_raise_re_raises_from_dispatch_outside_a_transaction(raising):
    with pytest.raises(RuntimeError, match="scripted failure"):
        scripted.using(backend="raising").dispatch(action="raise")
    assert scripted.using(backend="raising").dispatch(action="ok") == raising.last_results[-1].job_id


def test_raise_is_off_by_default(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        scripted.using(backend="sync").dispatch(action="raise")
    result = Jobs.backend("sync").last_results[-1]
    assert result.status == "dead-lettered"
    assert isinstance(result.exception, RuntimeError)


def test_raise_raises_a_rejections_refusal(raising, django_capture_on_commit_callbacks):
    with (
        pytest.raises(HandlerNotAllowed, match="unknown handler 'shop.jobs.not_deployed'"),
        django_capture_on_commit_callbacks(execute=True),
    ):
        Jobs.define("shop.jobs.not_deployed").dispatch("raising")
    forged = scripted.using(backend="raising").builder(action="ok").build()
    forged.payload = {"args": [], "kwargs": {"action": "raise"}}
    with pytest.raises(BadSignature):
        raising.enqueue(forged)


def test_raise_says_when_a_job_was_held_back_and_not_run(raising):
    assert CacheLock(SINGLE_LOCK, "another-delivery", 60).acquire()
    with pytest.raises(JobsError, match="single-instance lock is held"):
        raising.enqueue(scripted.using(backend="raising", single_instance=True).builder(key="held").build())
    assert not SideEffect.objects.filter(key="held").exists()


def test_raise_lets_successes_and_idempotent_skips_through(raising):
    first = scripted.using(backend="raising", idempotency_key="once").builder(action="ok").build()
    again = scripted.using(backend="raising", idempotency_key="once").builder(action="ok").build()
    raising.enqueue(first)
    raising.enqueue(again)
    assert [r.status for r in raising.last_results[-2:]] == ["acked", "skipped-idempotent"]


# -- jobs_work --once / --max in the caller's process -------------------------------------------------


def work(*argv: str) -> list[str]:
    """``jobs_work`` through ``call_command``; its output lines. A fork fails the test at once."""
    out = StringIO()
    with mock.patch.object(os, "fork", side_effect=AssertionError("a process was forked")):
        call_command("jobs_work", *argv, stdout=out)
    return out.getvalue().splitlines()


def test_jobs_work_once_runs_in_the_tests_process_and_transaction(engine, send):
    job_id = send(key="once")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    lines = work("--backend", engine.backend, "--once")
    assert lines[0].startswith(f"django-jobs worker started: backend={engine.backend} queues=default")
    assert [line.split()[:2] for line in lines[1:-1]] == [["completed", job_id]]
    assert lines[-1].startswith(f"django-jobs worker stopped: process {os.getpid()}, 1 deliveries")
    assert ran(engine, "once") == [os.getpid()]
    # The test's connection is still open, in its transaction, and the handlers are back.
    assert SideEffect.objects.using(engine.db).filter(key="once").exists()
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_jobs_work_max_runs_n_jobs_here():
    ids = [scripted.using(priority=3 - i).dispatch(action="ok", key=f"max{i}") for i in range(3)]
    lines = work("--max", "2")
    assert [line.split()[:2] for line in lines[1:-1]] == [["completed", i] for i in ids[:2]]
    assert [Job.objects.get(pk=i).status for i in ids] == ["completed", "completed", "pending"]


def stop_the_worker(context) -> None:
    """A ``JOBS["HANDLERS"]`` handler: SIGTERM to its own process, as a service manager sends."""
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_signal_ends_an_in_process_run_after_the_job_in_hand():
    received = []

    def tests_own(signum, frame):
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, tests_own)  # were the command's missing, pytest lives on
    try:
        with jobs_settings(HANDLERS={"stop-worker": f"{__name__}.stop_the_worker"}):
            stopper = Jobs.define("stop-worker").priority(5).dispatch()
            later = [scripted.dispatch(action="ok", key=f"later{i}") for i in range(2)]
            lines = work("--max", "3")
        assert signal.getsignal(signal.SIGTERM) is tests_own  # put back after the run
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == []  # the worker's handler had the signal while it ran
    assert [line.split()[:2] for line in lines[1:-1]] == [["completed", stopper]]
    assert [Job.objects.get(pk=i).status for i in later] == ["pending", "pending"]


@pytest.mark.parametrize("argv", [["--once", "--concurrency", "2"], ["--max", "4", "--concurrency", "3"], []])
def test_jobs_work_forks_its_pool_otherwise(argv):
    with (
        mock.patch.object(WorkerPool, "install_signal_handlers"),
        mock.patch.object(WorkerPool, "run", return_value=0) as pool_run,
    ):
        work(*argv)
    pool_run.assert_called_once()
