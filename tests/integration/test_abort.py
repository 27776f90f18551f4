"""Aborting jobs (``operations.abort_jobs``, ``Jobs.abort``, ``jobs_abort``, the admin's *Abort*
action and button): a pending job is cancelled at once, a running one is flagged and its
worker's heartbeat stops it, a finished one is left alone. On the database backend (SQLite and
PostgreSQL) and on Redis; the brokers that cannot look a job up by id say so."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from django_jobs import Jobs, current_job, operations, timeouts
from django_jobs.backends.base import AbortAsked, Requeue
from django_jobs.exceptions import AbortNotSupported, AbortRequested, LeaseLost
from django_jobs.heartbeat import Heartbeat
from django_jobs.metrics import InMemoryMetricsCollector
from django_jobs.models import Job, JobAttempt
from django_jobs.pipeline import JobContext, abort_verdict
from django_jobs.reaper import Reaper
from django_jobs.signals import job_started
from django_jobs.worker import QueueWorker
from tests.api_support import alias, row, runs
from tests.testapp import tasks as t
from tests.testapp.jobs import abortable_job, scripted, whoami

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]

# The worker whose heartbeat ``aborts_itself`` beats by hand, and what that job saw.
WORKER: dict[str, QueueWorker] = {}
SEEN: list[bool] = []


def aborts_itself(context: JobContext) -> str:
    """A ``JOBS["HANDLERS"]`` handler: asks to abort its own job, lets the heartbeat beat once
    on this thread (unless its payload says ``"beat": false``), and notes whether its context
    then says it was aborted. ``sleep`` in its payload: then it sleeps that long (``JobAborted``
    interrupts it); ``fail``: then it raises."""
    Jobs.abort(context.job_id)
    if context.payload.get("beat", True):
        WORKER["worker"].heartbeat._beat(context.lease, ())
    SEEN.append(context.aborted)
    if context.payload.get("sleep"):
        time.sleep(context.payload["sleep"])
    if context.payload.get("fail"):
        raise RuntimeError("boom")
    return "finished anyway"


@pytest.fixture
def self_aborting(settings: Any) -> Iterator[Callable[[float], None]]:
    """Registers ``aborts_itself``; call the fixture's value with the ``ABORT_GRACE`` to use."""

    def grace(seconds: float) -> None:
        handlers = {"aborts-itself": f"{__name__}.aborts_itself"}
        settings.JOBS = {**settings.JOBS, "HANDLERS": handlers, "ABORT_GRACE": seconds}

    SEEN.clear()
    yield grace
    WORKER.clear()


def attempts_of(db: str, job_id: str) -> list[tuple[int, str, str, str]]:
    return [
        (a.attempt, a.outcome, a.worker_id, a.error)
        for a in JobAttempt.objects.using(db).filter(job_id=job_id).order_by("id")
    ]


def told_on_beat_of(queue: Any, lease: Any) -> list[str]:
    """Beat ``lease`` once: who the heartbeat was told asked to abort its job."""
    beat, told = Heartbeat(queue, lease_seconds=30), []
    beat.watch(lease, (), told.append)
    beat._beat(lease, ())
    return told


def command(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    try:
        call_command("jobs_abort", *args, stdout=out, stderr=err)
    except CommandError as exc:
        err.write(f"CommandError: {exc}")
    return out.getvalue(), err.getvalue()


# -- pending, running, finished: the database backend -------------------------------------------


def test_aborting_a_pending_job_cancels_it_with_who_asked(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok", key="a-pending")

    outcome = operations.abort_jobs([job_id], "admin:boss")

    assert (outcome.cancelled, outcome.asked, outcome.finished, outcome.unknown) == ([job_id], [], {}, [])
    cancelled = row(backend, job_id)
    assert (cancelled.status, cancelled.last_error, cancelled.attempts) == ("cancelled", "Aborted by boss (admin)", 0)
    assert attempts_of(alias(backend), job_id) == [(1, "cancelled", "admin:boss", "Aborted by boss (admin)")]
    assert QueueWorker(backend).process_once().status == "empty"


def test_aborting_a_running_job_flags_it_and_a_beat_tells_the_worker(backend):
    job_id = scripted.using(backend=backend).dispatch(action="ok")
    queue = Jobs.backend(backend)
    lease = queue.fetch("default")
    assert lease is not None and lease.token == job_id
    beat = Heartbeat(queue, lease_seconds=30)
    told: list[str] = []
    beat.watch(lease, (), told.append)

    beat._beat(lease, ())
    assert told == []  # not asked yet
    assert Jobs.abort(job_id, "ops") == "aborting"
    assert row(backend, job_id).status == "in_progress"  # it runs on until its worker stops it
    beat._beat(lease, ())
    beat._beat(lease, ())

    assert told == ["ops"]  # told once
    assert row(backend, job_id).leased_until == lease.expires_at  # the beat still extended it


def told_on_beat(queue_name: str) -> list[str]:
    """Fetch the next job of ``queue_name``'s default queue and beat it once: who asked to abort it."""
    queue = Jobs.backend(queue_name)
    lease = queue.fetch("default")
    assert lease is not None
    return told_on_beat_of(queue, lease)


def test_aborting_a_job_waiting_for_its_retry_cancels_it(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="raise")
    assert QueueWorker(backend).process_once().status == "requeued"

    assert Jobs.abort(job_id, "ops") == "cancelled"

    cancelled = row(backend, job_id)
    assert (cancelled.status, cancelled.attempts, cancelled.last_error) == ("cancelled", 1, "Aborted by ops")
    assert [a[:2] for a in attempts_of(alias(backend), job_id)] == [(1, "retrying"), (2, "cancelled")]
    assert attempts_of(alias(backend), job_id)[1][2] == "ops"


def test_a_job_asked_to_abort_is_never_requeued_and_a_retry_clears_the_request(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok")
    queue = Jobs.backend(backend)
    lease = queue.fetch("default")
    assert Jobs.abort(job_id, "ops") == "aborting"

    # Its run failed, was deferred, or is handed back before a beat saw the abort: refused.
    with pytest.raises(AbortRequested) as refused:
        queue.nack(lease, 0, error="boom")
    assert refused.value.requested_by == "ops"
    with pytest.raises(AbortRequested):
        queue.release(lease)
    assert row(backend, job_id).status == "in_progress"  # the lease is still held, for the cancel
    queue.cancel(lease, "Aborted by ops")
    assert (row(backend, job_id).status, row(backend, job_id).attempts) == ("cancelled", 1)

    assert operations.retry_jobs(Job.objects.using(alias(backend)).filter(pk=job_id)).retried == 1
    assert row(backend, job_id).abort_requested is None
    assert told_on_beat(backend) == []


def test_a_requeue_written_with_a_batch_is_refused_for_a_job_asked_to_abort(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok")
    queue = Jobs.backend(backend)
    lease = queue.fetch("default")
    assert Jobs.abort(job_id, "ops") == "aborting"

    assert queue.settle_many([], (), [Requeue(lease, time.time(), "boom")]) == ([], ["ops"])
    assert row(backend, job_id).status == "in_progress"  # the lease is still held, for the cancel
    queue.cancel(lease, "Aborted by ops")
    assert (row(backend, job_id).status, row(backend, job_id).attempts) == ("cancelled", 1)


def test_aborting_a_finished_job_leaves_it_alone(backend):
    job_id = scripted.using(backend=backend).dispatch(action="ok")
    assert QueueWorker(backend).process_once().status == "acked"
    before = row(backend, job_id)

    assert Jobs.abort(job_id) == "finished"
    out, err = command(job_id)

    assert f"{job_id}: already finished (it is completed); left alone" in err
    assert "CommandError: none of the given jobs was aborted or cancelled" in err
    assert "cancelled 0, asked 0 to abort" in out
    after = row(backend, job_id)
    assert (after.status, after.updated_at, after.abort_requested) == ("completed", before.updated_at, None)
    assert not JobAttempt.objects.using(alias(backend)).filter(job_id=job_id, outcome="cancelled").exists()


def test_jobs_abort_reports_each_id_and_records_its_by_name(backend):
    pending = scripted.using(backend=backend).dispatch(action="ok")

    out, err = command(pending, "no-such-job", "--by", "deploy-script")

    assert f"{pending}: cancelled" in out and "cancelled 1, asked 0 to abort" in out
    assert "no-such-job: no such job" in err and "CommandError" not in err
    assert attempts_of(alias(backend), pending)[0][1:3] == ("cancelled", "deploy-script")


def test_a_repeated_abort_says_who_asked_first_and_when_and_is_not_an_error(backend):
    job_id = scripted.using(backend=backend).dispatch(action="ok")
    queue = Jobs.backend(backend)
    lease = queue.fetch("default")
    assert lease is not None and lease.token == job_id

    out, _ = command(job_id, "--by", "admin:boss")
    assert f"{job_id}: running; asked to abort: its worker stops it within about 11 s" in out  # ABORT_GRACE 10
    asked = row(backend, job_id)
    assert asked.abort_requested == "admin:boss" and asked.abort_requested_at is not None

    again = operations.abort_jobs([job_id], "ops")
    out, err = command(job_id, "--by", "ops")

    assert (again.asked, again.already) == ([], {job_id: AbortAsked("admin:boss", asked.abort_requested_at)})
    when = asked.abort_requested_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert f"{job_id}: running; abort already requested by admin:boss at {when} UTC; left as it is" in out
    assert "cancelled 0, asked 0 to abort, 1 already asked" in out and err == ""  # exit 0
    assert Jobs.abort(job_id, "ops") == "aborting"
    after = row(backend, job_id)
    assert (after.abort_requested, after.abort_requested_at, after.updated_at) == (
        "admin:boss",
        asked.abort_requested_at,
        asked.updated_at,
    )
    assert told_on_beat_of(queue, lease) == ["admin:boss"]  # the first request stands


def test_an_id_no_backend_holds_is_refused_naming_the_backends_that_cannot_look(redis_up):
    with pytest.raises(AbortNotSupported, match="'beanstalk'.*'servicebus'"):
        Jobs.abort("no-such-job")


# -- the worker: a flag seen by a beat stops the run, which ends cancelled ----------------------


def test_a_job_told_to_abort_sees_it_and_ends_cancelled_never_retried(backend, self_aborting):
    self_aborting(60)  # it returns long before JobAborted could interrupt it
    job_id = Jobs.define("aborts-itself", {}).max_retries(3).dispatch(backend=backend)
    metrics = InMemoryMetricsCollector()
    WORKER["worker"] = worker = QueueWorker(backend, metrics=metrics)

    result = worker.process_once()

    assert SEEN == [True]
    assert (result.status, result.label, result.error) == ("cancelled", "cancelled", "Aborted by api")
    ended = row(backend, job_id)
    assert (ended.status, ended.attempts, ended.last_error) == ("cancelled", 1, "Aborted by api")
    [attempt] = JobAttempt.objects.using(alias(backend)).filter(job_id=job_id)
    assert (attempt.outcome, attempt.worker_id, attempt.error_class) == ("cancelled", "api", "")
    assert metrics.get("jobs_aborted", queue="default") == 1
    assert worker.process_once().status == "empty"  # no retry


def test_a_job_that_ignores_the_abort_is_interrupted_by_job_aborted_after_the_grace(backend, self_aborting):
    self_aborting(0.05)
    job_id = Jobs.define("aborts-itself", {"sleep": 30}).max_retries(3).dispatch(backend=backend)
    WORKER["worker"] = worker = QueueWorker(backend)
    results: list[Any] = []

    worker.run(once=True, on_result=results.append)  # the loop: its alarm interrupts any job

    [result] = results
    assert result.status == "cancelled" and type(result.exception).__name__ == "JobAborted"
    ended = row(backend, job_id)
    assert ended.status == "cancelled"
    assert ended.last_error.startswith(
        "Aborted by api\nJobAborted: Aborted by api: still running after the abort grace"
    )
    [attempt] = JobAttempt.objects.using(alias(backend)).filter(job_id=job_id)
    assert (attempt.outcome, attempt.error_class) == ("cancelled", "django_jobs.exceptions.JobAborted")


def test_a_run_that_fails_after_the_abort_before_a_beat_ends_cancelled_not_retried(backend, self_aborting):
    self_aborting(60)
    job_id = Jobs.define("aborts-itself", {"beat": False, "fail": True}).max_retries(3).dispatch(backend=backend)
    WORKER["worker"] = worker = QueueWorker(backend)

    result = worker.process_once()

    assert SEEN == [False]  # no beat told it: it failed, and its retry was refused
    assert result.status == "cancelled"
    assert (result.error or "").splitlines()[0] == "Aborted by api" and "RuntimeError: boom" in (result.error or "")
    ended = row(backend, job_id)
    assert (ended.status, ended.attempts) == ("cancelled", 1)
    [attempt] = JobAttempt.objects.using(alias(backend)).filter(job_id=job_id)
    assert (attempt.outcome, attempt.worker_id, attempt.error_class) == ("cancelled", "api", "builtins.RuntimeError")
    assert worker.process_once().status == "empty"  # no retry


class TellingSupervisor:
    """A pool's supervisor, as a batching run tells it of its failed runs not written yet."""

    def in_hand(self, lease: Any, running: bool) -> None:
        pass

    def unwritten(self, lease: Any) -> bool:
        return True

    def written(self, leases: Any) -> None:
        pass


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)  # the run batches outside it
@pytest.mark.parametrize("supervised", [True, False], ids=["requeue-with-the-batch", "requeue-at-once"])
def test_a_fast_failure_asked_to_abort_in_a_batching_run_leaves_one_cancelled_row(backend, self_aborting, supervised):
    """The run's row is written before its requeue (so that no retry is claimable before it);
    the requeue is refused, the job asked to abort: that row becomes the cancelled one."""
    self_aborting(60)
    job_id = Jobs.define("aborts-itself", {"beat": False, "fail": True}).max_retries(3).dispatch(backend=backend)
    WORKER["worker"] = worker = QueueWorker(backend, prefetch=10)
    worker.supervisor = TellingSupervisor() if supervised else None
    results: list[Any] = []

    assert worker.run(once=True, on_result=results.append, reap=False) == 1

    assert SEEN == [False]
    assert (row(backend, job_id).status, row(backend, job_id).attempts) == ("cancelled", 1)
    # With the batch, the refusal is found after the run's result (its requeue waited for the write).
    statuses = [result.status for result in results]
    if supervised:
        assert statuses == ["requeued"]
    else:  # at once, unless its start was written before it failed (a slow run): then with the batch too
        assert statuses in (["cancelled"], ["requeued"])
    [attempt] = JobAttempt.objects.using(alias(backend)).filter(job_id=job_id)
    assert (attempt.attempt, attempt.outcome, attempt.worker_id) == (1, "cancelled", "api")
    assert attempt.error.splitlines()[0] == "Aborted by api" and "RuntimeError: boom" in attempt.error


@pytest.mark.parametrize("check", ["extend", "begin"])
def test_an_abort_the_start_check_finds_keeps_the_job_from_running(backend, check):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok", key="never", db=alias(backend))
    queue = Jobs.backend(backend)
    lease = queue.fetch("default")
    assert Jobs.abort(job_id, "ops") == "aborting"  # between its claim and its start
    if check == "begin":
        lease.must_begin = True  # an earlier claim of it ahead was lost: its start is recorded first
    else:
        lease.expires_at = timezone.now()  # much of its lease has passed: its start renews it first

    result = QueueWorker(backend).process(lease)

    assert (result.status, result.attempt, result.error) == ("cancelled", 0, "Aborted by ops")
    assert runs("never", alias(backend)) == 0
    ended = row(backend, job_id)
    assert (ended.status, ended.attempts) == ("cancelled", 0)
    assert attempts_of(alias(backend), job_id) == [(1, "cancelled", "ops", "Aborted by ops")]


def test_an_abort_passed_on_after_the_run_ended_leaves_it_completed(backend, self_aborting, monkeypatch):
    self_aborting(0)
    job_id = Jobs.define("aborts-itself", {"beat": False}).max_retries(3).dispatch(backend=backend)
    WORKER["worker"] = worker = QueueWorker(backend)
    armed: list[object] = []
    end_of_run = timeouts.TimeLimit.__exit__

    def then_a_beat(limit: timeouts.TimeLimit, *exc_info: Any) -> None:
        end_of_run(limit, *exc_info)
        # The heartbeat's beat lands just after the run ended, before the worker settles it.
        lease = worker.heartbeat._lease
        assert lease is not None
        worker.heartbeat._beat(lease, ())
        armed.append(worker.heartbeat._deadline)

    monkeypatch.setattr(timeouts.TimeLimit, "__exit__", then_a_beat)
    result = worker.process_once()

    assert (SEEN, armed) == ([False], [None])  # too late: nothing to stop, no kill armed
    assert result.status == "acked"
    assert row(backend, job_id).status == "completed"
    assert not JobAttempt.objects.using(alias(backend)).filter(job_id=job_id, outcome="cancelled").exists()


@pytest.mark.parametrize("claim", ["single", "ahead"])
def test_the_reaper_cancels_a_job_asked_to_abort_whose_worker_was_lost(backend, claim):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok")
    queue = Jobs.backend(backend)
    [lease] = queue.fetch_many("default", 5) if claim == "ahead" else [queue.fetch("default")]
    assert Jobs.abort(job_id, "ops") == "aborting"
    queue.lose_claims("default", lease.owner_token, [lease.token] if claim == "single" else [])

    assert Reaper(queue, ["default"]).reap_once() == 1

    ended, counted = row(backend, job_id), int(claim == "single")  # a claim ahead may never have run
    assert (ended.status, ended.attempts, ended.abort_requested) == ("cancelled", counted, "ops")
    assert ended.last_error.startswith("Aborted by ops\nWorkerLost: ")
    [attempt] = JobAttempt.objects.using(alias(backend)).filter(job_id=job_id)
    assert (attempt.attempt, attempt.outcome, attempt.worker_id, attempt.error_class) == (
        1,
        "cancelled",
        "ops",
        "django_jobs.exceptions.WorkerLost",
    )
    # The lost worker's own settle comes too late: fenced off, nothing recorded twice.
    with pytest.raises(LeaseLost):
        queue.cancel(lease, "Aborted by ops")
    assert QueueWorker(backend).pipeline.settle(lease, abort_verdict("ops", count_run=True)).status == "lease-lost"
    assert JobAttempt.objects.using(alias(backend)).filter(job_id=job_id).count() == 1
    assert QueueWorker(backend).process_once().status == "empty"


def test_a_job_held_ahead_that_is_asked_to_abort_is_cancelled_not_handed_back(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok", key="held", db=alias(backend))
    worker = QueueWorker(backend)
    [lease] = worker.backend.fetch_many("default", 5)
    worker.batches.hold(lease)  # claimed ahead of its run, behind a long job
    assert Jobs.abort(job_id, "ops") == "aborting"

    worker.batches.hand_back()

    ended = row(backend, job_id)
    assert (ended.status, ended.attempts, ended.last_error) == ("cancelled", 0, "Aborted by ops")
    assert attempts_of(alias(backend), job_id) == [(1, "cancelled", "ops", "Aborted by ops")]
    assert worker.process_once().status == "empty" and runs("held", alias(backend)) == 0


def test_who_asks_is_named_in_1_to_150_characters(backend):
    job_id = scripted.using(backend=backend).dispatch(action="ok")

    for bad in ("", "   ", "x" * 151):
        with pytest.raises(ValueError, match="requested_by"):
            Jobs.abort(job_id, bad)
    _, err = command(job_id, "--by", "")

    assert "CommandError: requested_by" in err
    assert row(backend, job_id).status == "pending"
    assert Jobs.abort(job_id, "x" * 150) == "cancelled"


# -- current_job(): the running job's context, for @job and @task functions ----------------------


def test_a_job_function_reads_its_context_with_current_job(backend):
    job_id = whoami.using(backend=backend, keep_result=True).dispatch()

    assert current_job() is None  # outside a job
    assert QueueWorker(backend).process_once().status == "acked"

    assert row(backend, job_id).result == {"job_id": job_id, "attempt": 1, "aborted": False}
    assert current_job() is None  # reset after the run


def test_a_job_function_sees_the_abort_through_current_job_and_returns(backend, settings):
    settings.JOBS = {**settings.JOBS, "ABORT_GRACE": 60}
    # The timeout is a safety net: were the abort not seen, JobAborted would end the job at 5 s.
    job_id = abortable_job.using(backend=backend, timeout=5).dispatch(mode="cooperative")
    worker = QueueWorker(backend)

    def abort_as_it_starts(sender: Any, envelope: Any, context: JobContext, **kwargs: Any) -> None:
        Jobs.abort(envelope.id, "ops")
        worker.heartbeat._beat(context.lease, ())

    job_started.connect(abort_as_it_starts, weak=False)
    try:
        result = worker.process_once()
    finally:
        job_started.disconnect(abort_as_it_starts)

    assert (result.status, result.error, result.exception) == ("cancelled", "Aborted by ops", None)
    assert row(backend, job_id).status == "cancelled"


@pytest.mark.parametrize("task", [t.whoami, t.async_whoami], ids=["def", "async def"])
def test_a_task_reads_its_job_with_current_job(backend, task):
    result = task.using(backend=backend).enqueue()

    assert QueueWorker(backend).process_once().status == "acked"

    result.refresh()
    assert result.return_value == result.id


# -- Redis --------------------------------------------------------------------------------------


def redis_job(capture: Any, **options: Any) -> str:
    """A scripted job sent to Redis now (a dispatch waits for the test's transaction to commit)."""
    with capture(execute=True):
        return scripted.using(backend="redis", **options).dispatch(action="ok")


def test_redis_takes_a_waiting_job_out_and_records_it_cancelled(redis_up, django_capture_on_commit_callbacks):
    job_id = redis_job(django_capture_on_commit_callbacks, max_retries=3)

    assert Jobs.abort(job_id, "admin:boss") == "cancelled"

    assert Jobs.backend("redis").peek(job_id) is None
    cancelled = Job.objects.get(pk=job_id)
    assert (cancelled.status, cancelled.backend, cancelled.last_error) == (
        "cancelled",
        "redis",
        "Aborted by boss (admin)",
    )
    assert attempts_of("default", job_id) == [(1, "cancelled", "admin:boss", "Aborted by boss (admin)")]
    assert QueueWorker("redis").process_once().status == "empty"


def test_redis_flags_a_running_job_for_its_beat_and_the_settle_records_it(redis_up, django_capture_on_commit_callbacks):
    job_id = redis_job(django_capture_on_commit_callbacks)
    queue = Jobs.backend("redis")
    lease = queue.fetch("default")
    assert lease is not None

    assert Jobs.abort(job_id, "ops") == "aborting"
    assert told_on_beat_of(queue, lease) == ["ops"]
    queue.cancel(lease, "Aborted by ops")

    assert queue.peek(job_id) is None
    assert redis_up.hget(queue.keys("default").aborts, job_id) is None  # the settle cleared the flag
    cancelled = Job.objects.get(pk=job_id)
    assert (cancelled.status, cancelled.attempts, cancelled.last_error) == ("cancelled", 1, "Aborted by ops")


def test_redis_a_repeated_abort_says_who_asked_first_and_is_not_an_error(redis_up, django_capture_on_commit_callbacks):
    job_id = redis_job(django_capture_on_commit_callbacks)
    queue = Jobs.backend("redis")
    lease = queue.fetch("default")
    assert lease is not None

    assert queue.request_abort(job_id, "admin:boss") == "asked"
    assert queue.request_abort(job_id, "ops") == AbortAsked("admin:boss")  # Redis keeps no time
    out, err = command(job_id, "--by", "ops")

    assert f"{job_id}: running; abort already requested by admin:boss; left as it is" in out
    assert "cancelled 0, asked 0 to abort, 1 already asked" in out and "CommandError" not in err
    assert Jobs.abort(job_id, "ops") == "aborting"
    assert queue.abort_requested(lease) == "admin:boss"
    assert told_on_beat_of(queue, lease) == ["admin:boss"]


def test_redis_takes_a_job_waiting_for_its_retry_out(redis_up, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        job_id = scripted.using(backend="redis", max_retries=3).dispatch(action="raise")
    assert QueueWorker("redis").process_once().status == "requeued"

    assert Jobs.abort(job_id, "ops") == "cancelled"

    cancelled = Job.objects.get(pk=job_id)
    assert (cancelled.status, cancelled.attempts, cancelled.last_error) == ("cancelled", 1, "Aborted by ops")
    assert [a[:3] for a in attempts_of("default", job_id)][1:] == [(2, "cancelled", "ops")]
    assert Jobs.backend("redis").peek(job_id) is None


def test_redis_never_requeues_a_job_asked_to_abort_and_a_new_dispatch_clears_it(
    redis_up, django_capture_on_commit_callbacks
):
    job_id = redis_job(django_capture_on_commit_callbacks, max_retries=3)
    queue = Jobs.backend("redis")
    lease = queue.fetch("default")
    assert Jobs.abort(job_id, "ops") == "aborting"

    with pytest.raises(AbortRequested) as refused:
        queue.nack(lease, 0, error="boom")
    assert refused.value.requested_by == "ops"
    with pytest.raises(AbortRequested):
        queue.release(lease)
    assert queue.extend(lease, 30) == "ops"  # still held, for the cancel
    queue.cancel(lease, "Aborted by ops")
    queue.enqueue(lease.envelope)  # a retry dispatches it again

    assert told_on_beat_of(queue, queue.fetch("default")) == []


def test_redis_a_run_that_fails_after_the_abort_ends_cancelled(
    redis_up, django_capture_on_commit_callbacks, self_aborting
):
    self_aborting(60)
    with django_capture_on_commit_callbacks(execute=True):
        job_id = Jobs.define("aborts-itself", {"beat": False, "fail": True}).max_retries(3).dispatch(backend="redis")
    WORKER["worker"] = worker = QueueWorker("redis")

    assert worker.process_once().status == "cancelled"

    cancelled = Job.objects.get(pk=job_id)
    assert (cancelled.status, cancelled.attempts, cancelled.backend) == ("cancelled", 1, "redis")
    assert attempts_of("default", job_id)[0][:3] == (1, "cancelled", "api")
    assert worker.process_once().status == "empty"


@pytest.mark.parametrize("claim", ["single", "ahead"])
def test_redis_the_reaper_cancels_a_job_asked_to_abort_whose_worker_was_lost(
    redis_up, django_capture_on_commit_callbacks, claim
):
    job_id = redis_job(django_capture_on_commit_callbacks, max_retries=3)
    queue = Jobs.backend("redis")
    [lease] = queue.fetch_many("default", 5) if claim == "ahead" else [queue.fetch("default")]
    assert Jobs.abort(job_id, "ops") == "aborting"
    queue.lose_claims("default", lease.owner_token, [lease.token] if claim == "single" else [])

    assert Reaper(queue, ["default"]).reap_once() == 1

    assert queue.peek(job_id) is None
    assert redis_up.hget(queue.keys("default").aborts, job_id) is None
    cancelled = Job.objects.get(pk=job_id)
    assert (cancelled.status, cancelled.attempts) == ("cancelled", int(claim == "single"))
    assert cancelled.last_error.startswith("Aborted by ops\nWorkerLost: ")
    assert attempts_of("default", job_id)[0][:3] == (1, "cancelled", "ops")
    with pytest.raises(LeaseLost):
        queue.cancel(lease, "Aborted by ops")
    assert QueueWorker("redis").process_once().status == "empty"


# -- the admin ----------------------------------------------------------------------------------


def test_the_admin_action_aborts_pending_and_running_jobs_and_logs_each(admin_client):
    pending = scripted.dispatch(action="ok")
    running = scripted.dispatch(action="ok")
    lease = Jobs.backend("default").fetch("default")
    assert lease is not None and lease.token == pending
    pending, running = running, pending  # the first dispatched was claimed: it runs
    done = scripted.dispatch(action="ok")
    Job.objects.filter(pk=done).update(status="completed")

    url = reverse("admin:django_jobs_job_changelist")
    response = admin_client.post(url, {"action": "abort", "_selected_action": [pending, running, done]}, follow=True)

    said = [str(m) for m in response.context["messages"]]
    assert said == [
        "Cancelled 1 job(s) before they ran.",
        "Asked 1 running job(s) to abort: each ends cancelled, its worker stops it within about 11 s.",
        "1 selected job(s) had already finished and were left alone.",
    ]
    assert Job.objects.get(pk=pending).status == "cancelled"
    assert Job.objects.get(pk=running).abort_requested == "admin:admin"
    assert attempts_of("default", pending)[0][1:3] == ("cancelled", "admin:admin")
    logged = {entry.object_id: entry.get_change_message() for entry in LogEntry.objects.all()}
    assert logged == {
        pending: "Aborted: Cancelled (was pending, never run)",
        running: "Asked to abort while running",
    }


def test_the_admin_action_on_a_job_asked_before_says_who_asked_and_logs_nothing(admin_client):
    job_id = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None
    assert Jobs.abort(job_id, "admin:boss") == "aborting"
    asked_at = Job.objects.get(pk=job_id).abort_requested_at
    assert asked_at is not None

    url = reverse("admin:django_jobs_job_changelist")
    response = admin_client.post(url, {"action": "abort", "_selected_action": [job_id]}, follow=True)

    when = timezone.localtime(asked_at).strftime("%Y-%m-%d %H:%M:%S")
    said = [(m.level_tag, str(m)) for m in response.context["messages"]]
    assert said == [
        ("info", f"Abort already requested, left as it is: {job_id[:8]} requested by admin:boss at {when}.")
    ]
    assert Job.objects.get(pk=job_id).abort_requested == "admin:boss"
    assert not LogEntry.objects.exists()


def test_a_running_jobs_page_has_an_abort_button_that_posts(admin_client):
    job_id = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None
    page = reverse("admin:django_jobs_job_change", args=[job_id])
    button = reverse("admin:django_jobs_job_abort", args=[job_id])

    assert f'action="{button}"' in admin_client.get(page).content.decode()
    assert admin_client.get(button).status_code == 405  # POST only
    assert admin_client.post(button).status_code == 302

    assert Job.objects.get(pk=job_id).abort_requested == "admin:admin"


def test_a_view_only_staff_user_has_no_abort_button_and_is_refused(client, django_user_model):
    viewer = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    job_id = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None
    button = reverse("admin:django_jobs_job_abort", args=[job_id])

    assert button not in client.get(reverse("admin:django_jobs_job_change", args=[job_id])).content.decode()
    assert client.post(button).status_code == 403
    assert Job.objects.get(pk=job_id).abort_requested is None


def test_an_admin_user_with_the_longest_name_is_recorded_cut_to_fit(client, django_user_model):
    name = "u" * 150
    client.force_login(django_user_model.objects.create_superuser(name, password="x"))
    job_id = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None

    assert client.post(reverse("admin:django_jobs_job_abort", args=[job_id])).status_code == 302

    assert Job.objects.get(pk=job_id).abort_requested == f"admin:{name}"[:150]
