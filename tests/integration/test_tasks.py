"""``django.tasks`` on django-jobs, in this process: ``JobsTaskBackend``'s flags and checks, what
``enqueue`` dispatches, and the ``TaskResult`` read back after the worker's pipeline ran the job
(status, return value, one error per failed attempt, worker ids, times) on the database backend
(SQLite and PostgreSQL), Redis and sync. The same tasks run in worker processes in
tests/processes/test_tasks_worker.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from django_jobs import history, registry, signing
from django_jobs.backends import get_backend
from django_jobs.exceptions import InvalidPayload
from django_jobs.models import Job, JobAttempt, envelope_of
from django_jobs.operations import retry_jobs
from django_jobs.tasks import (
    HISTORY_GRACE,
    InvalidTask,
    JobsTask,
    JobsTaskBackend,
    TaskHandler,
    TaskResultDoesNotExist,
    TaskResultStatus,
)
from django_jobs.worker import QueueWorker
from tests.api_support import drain, jobs_settings
from tests.procs import wait_until
from tests.testapp import tasks as t
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

try:
    from django.tasks import task, task_backends
    from django.tasks.exceptions import TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started

    TASKS_LOGGER = "django.tasks"
except ImportError:  # Django 5.2: the backport
    from django_tasks import task, task_backends
    from django_tasks.exceptions import TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started

    TASKS_LOGGER = "django_tasks"

DBS = pytest.mark.django_db(databases=["default", "postgres"])
BACKEND_FIELD = "backend"


def plain(x: int) -> int:
    """A module-level function for tests that build their own ``@task``."""
    return x


class SubclassBackend(JobsTaskBackend):
    """A project's own subclass still runs its tasks on django-jobs."""


@contextmanager
def tasks_on(jobs_backend: str, *, alias: str = "t", queues: list[str] | None = None, **extra: Any) -> Iterator[Any]:
    """``TASKS[alias]`` enqueues on the JOBS backend ``jobs_backend`` (the test aliases stay)."""
    params: dict[str, Any] = {
        "BACKEND": "django_jobs.tasks.JobsTaskBackend",
        "QUEUES": queues or [],
        "OPTIONS": {"backend": jobs_backend, **extra},
    }
    with override_settings(TASKS={**settings.TASKS, alias: params}):
        yield task_backends[alias]


def worker(jobs_backend: str) -> QueueWorker:
    return QueueWorker(jobs_backend, ["default", "emails"])


@contextmanager
def captured(signal: Any) -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        sent.append({"sender": sender, "result": task_result})

    signal.connect(receiver)
    try:
        yield sent
    finally:
        signal.disconnect(receiver)


# -- flags, construction and checks -----------------------------------------------------------

# What each engine supports, as docs/tasks.md states it: (defer, priority, get_result).
ENGINE_FLAGS = {
    "default": (True, True, True),  # database: rows, ordered by priority, readable by id
    "redis": (True, True, True),  # delayed set, priority scores, peek by id
    "beanstalk": (True, True, False),  # no lookup of a waiting message by id
    "servicebus": (True, False, False),  # no priority, no lookup by id
    "sync": (False, True, True),  # runs at enqueue: nothing to defer or reorder; its record stays
}


@pytest.mark.parametrize("jobs_backend", list(ENGINE_FLAGS))
def test_flags_follow_the_engine_of_the_jobs_backend(jobs_backend):
    with tasks_on(jobs_backend) as backend:
        flags = (backend.supports_defer, backend.supports_priority, backend.supports_get_result)
        assert flags == ENGINE_FLAGS[jobs_backend]
        assert backend.supports_async_task is True
        assert backend.jobs_backend_name == jobs_backend


def test_the_flags_are_enforced_where_an_engine_lacks_the_feature():
    soon = timezone.now() + timedelta(minutes=5)
    with tasks_on("sync"), pytest.raises(InvalidTask, match="run_after"):
        t.add.using(backend="t", run_after=soon)
    with tasks_on("servicebus"), pytest.raises(InvalidTask, match="priority"):
        t.add.using(backend="t", priority=5)
    with tasks_on("beanstalk") as backend, pytest.raises(NotImplementedError, match="cannot look a job up by id"):
        backend.get_result("0" * 32)


def test_building_the_backend_and_reading_everything_static_connects_to_nothing():
    """Django builds task backends when a @task module is imported: nothing may connect then."""
    unreachable = {"ENGINE": "redis", "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}
    with (
        jobs_settings(BACKENDS={**settings.JOBS["BACKENDS"], "unreachable": unreachable}),
        tasks_on("unreachable") as backend,
    ):
        assert (backend.supports_defer, backend.supports_priority, backend.supports_get_result) == (True, True, True)
        assert backend.check() == []
        deferred = t.add.using(backend="t", priority=3, run_after=timezone.now() + timedelta(hours=1))
        assert deferred.get_backend() is backend
        assert get_backend("unreachable")._client is None  # never connected


def test_check_accepts_a_good_configuration_and_names_each_problem():
    with tasks_on("default", queues=["default", "emails"]) as backend:
        assert backend.check() == []
    with tasks_on("nowhere") as backend:
        assert [m.id for m in backend.check()] == ["django_jobs.T002"]
        assert "nowhere" in backend.check()[0].msg
    with tasks_on("default", colour="blue") as backend:
        assert [m.id for m in backend.check()] == ["django_jobs.T001"]
    with tasks_on("default", queues=["default", "missing"]) as backend:
        messages = backend.check()
        assert [m.id for m in messages] == ["django_jobs.T003"]
        assert "'missing'" in messages[0].msg


def test_the_default_jobs_backend_is_jobs_default_backend():
    params = {"BACKEND": "django_jobs.tasks.JobsTaskBackend", "OPTIONS": {}}
    with (
        jobs_settings(DEFAULT_BACKEND="redis"),
        override_settings(TASKS={**settings.TASKS, "t": params}),
    ):
        assert task_backends["t"].jobs_backend_name == "redis"


def test_autodiscovery_imports_tasks_modules_only_when_tasks_run_on_django_jobs():
    immediate = "django.tasks.backends.immediate.ImmediateBackend"
    if not settings.TASKS["default"]["BACKEND"].startswith("django_jobs"):
        pytest.fail("the test settings run the task tests on django-jobs")
    with override_settings(TASKS={"default": {"BACKEND": immediate}}):
        assert registry.tasks_use_django_jobs() is False
    subclass = {"BACKEND": f"{__name__}.SubclassBackend"}
    with override_settings(TASKS={**settings.TASKS, "default": subclass}):
        assert registry.tasks_use_django_jobs() is True
    assert registry.tasks_use_django_jobs() is True
    assert isinstance(registry.registered()["tests.testapp.tasks.add"], TaskHandler)


# -- the task class ---------------------------------------------------------------------------


def test_task_options_are_django_jobs_job_options():
    assert isinstance(t.flaky, JobsTask)
    assert (t.flaky.max_retries, t.flaky.backoff) == (3, {"strategy": "none"})
    changed = t.flaky.using(max_retries=5, timeout=12.5, idempotency_key="k", priority=7, queue_name="emails")
    assert (changed.max_retries, changed.timeout, changed.idempotency_key) == (5, 12.5, "k")
    assert (changed.priority, changed.queue_name, changed.backoff) == (7, "emails", {"strategy": "none"})
    assert t.flaky.max_retries == 3  # using() returns a copy
    # The first definition stays the registered handler.
    assert registry.registered()["tests.testapp.tasks.flaky"].task is t.flaky


@pytest.mark.parametrize(
    "options",
    [
        {"max_retries": -1},
        {"timeout": -1},
        {"timeout": math.inf},
        {"timeout": "soon"},
        {"idempotency_key": 7},
        {"backoff": {"strategy": "sometimes"}},
        {"backoff": {"base": -1}},
    ],
    ids=lambda o: next(iter(o.items())).__repr__(),
)
def test_bad_task_options_are_refused_when_the_task_is_defined(options):
    with pytest.raises(InvalidTask):
        task(**options)(plain)
    with pytest.raises(InvalidTask):
        task(plain).using(**options)


def test_a_queue_that_is_not_a_jobs_queue_is_refused():
    with pytest.raises(InvalidTask, match="JOBS"):
        t.add.using(queue_name="nowhere")
    with tasks_on("default", queues=["default"]):
        with pytest.raises(InvalidTask, match="emails"):
            t.add.using(backend="t", queue_name="emails")  # a JOBS queue, but not one of TASKS' QUEUES
        assert t.add.using(backend="t").queue_name == "default"


# -- enqueue ----------------------------------------------------------------------------------


@DBS
def test_enqueue_dispatches_a_signed_job_that_keeps_its_result(backend):
    with tasks_on(backend), captured(task_enqueued) as enqueued:
        before = timezone.now()
        result = t.add.using(backend="t").enqueue(2, y=3)
    assert result.status == TaskResultStatus.READY
    assert (result.args, result.kwargs, result.backend) == ([2], {"y": 3}, "t")
    assert before <= result.enqueued_at <= timezone.now()
    assert (result.started_at, result.finished_at, result.errors, result.worker_ids) == (None, None, [], [])
    row = Job.objects.using(get_backend(backend).alias).get(pk=result.id)
    assert (row.handler, row.name, row.status, row.backend) == (t.add.module_path,) * 2 + ("pending", backend)
    assert row.options["keep_result"] is True
    assert row.payload == {
        "args": [2],
        "kwargs": {"y": 3},
        BACKEND_FIELD: "t",
        "enqueued_at": result.enqueued_at.isoformat(),
    }
    signing.verify_delivery(envelope_of(row), row.queue)
    assert len(enqueued) == 1
    assert enqueued[0]["sender"] is JobsTaskBackend
    assert enqueued[0]["result"].id == result.id


@pytest.mark.django_db
def test_job_options_priority_and_run_after_reach_the_job():
    run_after = (timezone.now() + timedelta(hours=1)).replace(microsecond=0)
    result = t.flaky.using(
        priority=-100, timeout=12.5, idempotency_key="once", queue_name="emails", run_after=run_after
    ).enqueue(fail_times=0)
    row = Job.objects.get(pk=result.id)
    assert (row.priority, row.timeout, row.idempotency_key, row.queue) == (-100, 12.5, "once", "emails")
    assert (row.max_retries, row.options["backoff"], row.available_at) == (3, {"strategy": "none"}, run_after)
    read = t.flaky.get_result(result.id)
    assert read.task.run_after == run_after
    assert (read.task.priority, read.task.queue_name, read.task.timeout) == (-100, "emails", 12.5)
    assert worker("default").process_once().status == "empty"  # not due yet
    assert t.flaky.get_result(result.id).status == TaskResultStatus.READY


@pytest.mark.django_db
@pytest.mark.parametrize("naive", [True, False], ids=["naive", "aware"])
def test_run_after_with_use_tz_off_is_kept_in_the_time_zone(naive):
    """With ``USE_TZ = False`` a naive ``run_after`` is in the current time zone, and the job keeps
    its due time naive in that zone, as Django keeps every time then."""
    with override_settings(USE_TZ=False, TIME_ZONE="Europe/Amsterdam"):
        local = (timezone.now() + timedelta(hours=1)).replace(microsecond=0)  # naive, Amsterdam time
        run_after = local if naive else timezone.make_aware(local, timezone.get_default_timezone())
        result = t.flaky.using(run_after=run_after).enqueue(fail_times=0)
        assert Job.objects.get(pk=result.id).available_at == local
        assert worker("default").process_once().status == "empty"  # not due yet


@pytest.mark.django_db
def test_higher_priority_runs_first():
    low = t.add.using(priority=-5).enqueue(1)
    high = t.add.using(priority=100).enqueue(2)
    runs = drain(worker("default"))
    assert [r.job_id for r in runs] == [high.id, low.id]


@pytest.mark.django_db
def test_arguments_are_normalised_as_django_does_and_non_json_ones_are_refused():
    result = t.echo.enqueue((1, 2), b"bytes", key={"a": (3,)})
    assert (result.args, result.kwargs) == ([[1, 2], "bytes"], {"key": {"a": [3]}})
    for bad_args in ((timezone.now(),), (float("nan"),), ({1, 2},)):
        with pytest.raises(InvalidPayload):
            t.echo.enqueue(*bad_args)
    drain(worker("default"))
    assert Job.objects.count() == 1  # only the good one was dispatched
    assert t.echo.get_result(result.id).return_value == {"args": [[1, 2], "bytes"], "kwargs": {"key": {"a": [3]}}}


@pytest.mark.django_db
def test_a_return_value_that_is_not_json_fails_the_task_for_good():
    result = t.unkeepable.enqueue()
    assert [r.status for r in drain(worker("default"))] == ["dead-lettered"]  # not retried
    failed = t.unkeepable.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.errors[0].exception_class_path == "django_jobs.exceptions.InvalidPayload"
    assert "cannot be kept as JSON" in failed.errors[0].traceback


# -- results ------------------------------------------------------------------------------------


@DBS
def test_success_retries_and_failure_map_onto_the_task_result(backend):
    this_worker = history.worker_id()
    with tasks_on(backend):
        ok = t.add.using(backend="t").enqueue(2, y=3)
        flaky = t.flaky.using(backend="t").enqueue(fail_times=2)
        doomed = t.doomed.using(backend="t").enqueue("no luck")
        run = worker(backend)
        run.process_once()  # ok
        assert run.process_once().job_id == flaky.id  # attempt 1 fails: waiting for a retry
        flaky.refresh()
        assert (flaky.status, flaky.attempts, len(flaky.errors)) == (TaskResultStatus.READY, 1, 1)
        with pytest.raises(ValueError, match="not finished"):
            _ = flaky.return_value
        drain(run)

        ok.refresh()
        assert (ok.status, ok.return_value, ok.attempts, ok.errors) == (TaskResultStatus.SUCCESSFUL, 5, 1, [])
        assert ok.worker_ids == [this_worker]
        assert ok.enqueued_at <= ok.started_at == ok.last_attempted_at <= ok.finished_at

        flaky.refresh()
        assert flaky.status == TaskResultStatus.SUCCESSFUL
        assert flaky.return_value == 3  # the attempt TaskContext reported
        assert flaky.worker_ids == [this_worker] * 3
        assert [e.exception_class_path for e in flaky.errors] == ["tests.testapp.tasks.FlakyError"] * 2
        assert [e.exception_class for e in flaky.errors] == [t.FlakyError] * 2
        assert "attempt 1 failed" in flaky.errors[0].traceback
        assert "attempt 2 failed" in flaky.errors[1].traceback
        attempts = JobAttempt.objects.using(get_backend(backend).alias).filter(job_id=flaky.id).order_by("attempt")
        assert flaky.started_at == attempts[0].started_at < flaky.last_attempted_at == attempts[2].started_at

        doomed.refresh()
        assert (doomed.status, doomed.attempts, doomed.is_finished) == (TaskResultStatus.FAILED, 2, True)
        assert [e.exception_class_path for e in doomed.errors] == ["tests.testapp.tasks.DoomedError"] * 2
        assert doomed.finished_at is not None
        with pytest.raises(ValueError, match="failed"):
            _ = doomed.return_value


@pytest.mark.django_db
def test_an_async_task_runs_to_completion():
    result = t.async_add.enqueue(20, 22)
    assert drain(worker("default"))[0].status == "acked"
    assert t.async_add.get_result(result.id).return_value == 42


@pytest.mark.django_db
def test_a_leased_job_is_running_with_an_unknown_worker_for_its_attempt():
    result = t.add.enqueue(1)
    lease = get_backend("default").fetch("default")
    assert lease is not None
    running = t.add.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING
    assert running.worker_ids == [""]  # the worker is known once the attempt is recorded
    claimed = Job.objects.get(pk=result.id).updated_at
    assert running.started_at == running.last_attempted_at == claimed


@pytest.mark.django_db
def test_a_finished_job_whose_last_attempt_is_not_recorded_yet_still_reads_as_running():
    result = t.add.enqueue(1)
    drain(worker("default"))
    JobAttempt.objects.filter(job_id=result.id).delete()  # as between the ack and the history write
    finishing = t.add.get_result(result.id)
    assert (finishing.status, finishing.worker_ids) == (TaskResultStatus.RUNNING, [""])
    Job.objects.filter(pk=result.id).update(finished_at=timezone.now() - HISTORY_GRACE - timedelta(seconds=1))
    late = t.add.get_result(result.id)  # its history was never written: finished all the same
    assert (late.status, late.return_value, late.worker_ids) == (TaskResultStatus.SUCCESSFUL, 1, [""])


@pytest.mark.django_db
def test_without_a_history_a_finished_job_reads_as_finished_at_once():
    with jobs_settings(HISTORY_LIMIT=0):
        result = t.doomed.enqueue("x")
        drain(worker("default"))
        failed = t.doomed.get_result(result.id)
    assert (failed.status, failed.attempts, failed.errors) == (TaskResultStatus.FAILED, 2, [])


@pytest.mark.django_db
def test_an_admin_retry_starts_a_new_round_of_attempts():
    result = t.doomed.enqueue("again")
    drain(worker("default"))
    assert len(t.doomed.get_result(result.id).errors) == 2
    assert retry_jobs(Job.objects.filter(pk=result.id)).retried == 1
    retried = t.doomed.get_result(result.id)
    assert (retried.status, retried.attempts, retried.errors) == (TaskResultStatus.READY, 0, [])
    drain(worker("default"))
    failed = t.doomed.get_result(result.id)
    assert (failed.status, failed.attempts, len(failed.errors)) == (TaskResultStatus.FAILED, 2, 2)


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_state")
def test_a_task_skipped_by_its_idempotency_key_succeeded_without_running():
    first = t.add.using(idempotency_key="add-once").enqueue(1)
    second = t.add.using(idempotency_key="add-once").enqueue(2)
    assert [r.status for r in drain(worker("default"))] == ["acked", "skipped-idempotent"]
    assert t.add.get_result(first.id).return_value == 1
    skipped = t.add.get_result(second.id)
    assert (skipped.status, skipped.return_value, skipped.attempts) == (TaskResultStatus.SUCCESSFUL, None, 0)


@pytest.mark.django_db
def test_errors_and_worker_ids_cover_the_attempts_the_history_keeps():
    with jobs_settings(HISTORY_LIMIT=2):
        result = t.doomed.using(max_retries=3).enqueue("x")
        drain(worker("default"))
        failed = t.doomed.get_result(result.id)
    assert (failed.status, failed.attempts) == (TaskResultStatus.FAILED, 4)
    assert failed.worker_ids == ["", "", history.worker_id(), history.worker_id()]
    assert len(failed.errors) == 2


@DBS
def test_get_result_knows_only_this_backends_task_jobs():
    result = t.add.enqueue(1)
    with pytest.raises(TaskResultDoesNotExist):
        t.add.get_result("f" * 32)
    with pytest.raises(TaskResultDoesNotExist):  # a plain @job is not a task
        task_backends["default"].get_result(scripted.dispatch(action="ok"))
    with pytest.raises(TaskResultDoesNotExist):  # the job of another TASKS alias's JOBS backend
        task_backends["pg"].get_result(result.id)
    with pytest.raises(TaskResultMismatch):
        t.echo.get_result(result.id)
    assert async_to_sync(t.add.aget_result)(result.id).id == result.id


# -- signals ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_started_per_attempt_and_finished_once_the_task_succeeded_or_failed_for_good():
    with captured(task_started) as started, captured(task_finished) as finished:
        flaky = t.flaky.enqueue(fail_times=2)
        doomed = t.doomed.enqueue("x")
        drain(worker("default"))
    mine = history.worker_id()
    flaky_started = [s["result"] for s in started if s["result"].id == flaky.id]
    assert [(r.status, r.attempts, r.worker_ids[-1]) for r in flaky_started] == [
        (TaskResultStatus.RUNNING, n, mine) for n in (1, 2, 3)
    ]
    assert [len(r.errors) for r in flaky_started] == [0, 1, 2]
    assert {s["sender"] for s in started + finished} == {JobsTaskBackend}
    done = {s["result"].id: s["result"] for s in finished}
    assert len(finished) == 2  # a failed attempt that is retried does not finish the task
    assert (done[flaky.id].status, done[flaky.id].return_value, done[flaky.id].attempts) == (
        TaskResultStatus.SUCCESSFUL,
        3,
        3,
    )
    assert (done[doomed.id].status, len(done[doomed.id].errors)) == (TaskResultStatus.FAILED, 2)


# -- sync and Redis ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_on_sync_the_task_has_run_when_its_transaction_commits(django_capture_on_commit_callbacks):
    with tasks_on("sync"), django_capture_on_commit_callbacks(execute=True):
        ok = t.add.using(backend="t").enqueue(4, y=5)
        doomed = t.doomed.using(backend="t").enqueue("inline")
    with tasks_on("sync"):
        assert ok.status == TaskResultStatus.READY  # as enqueue() returned it
        ok.refresh()
        assert (ok.status, ok.return_value, ok.worker_ids) == (TaskResultStatus.SUCCESSFUL, 9, [history.worker_id()])
        doomed.refresh()  # sync runs each job once: no retry
        assert (doomed.status, len(doomed.errors)) == (TaskResultStatus.FAILED, 1)


@pytest.mark.django_db(transaction=True)  # Redis receives a job when its transaction commits
def test_redis_results_come_from_redis_while_live_and_from_the_database_once_finished(redis_up):
    redis, read = get_backend("redis"), task_backends["redis"].get_result
    flaky = t.flaky.using(backend="redis").enqueue(fail_times=1)
    assert redis.peek(flaky.id).state == "pending"
    assert read(flaky.id).status == TaskResultStatus.READY
    lease = redis.fetch("default")
    assert redis.peek(flaky.id).state == "in_progress"
    running = read(flaky.id)
    assert (running.status, running.worker_ids) == (TaskResultStatus.RUNNING, [""])
    worker("redis").process(lease)  # attempt 1 fails
    waiting = read(flaky.id)
    assert (waiting.status, waiting.attempts, len(waiting.errors)) == (TaskResultStatus.READY, 1, 1)
    drain(worker("redis"))
    assert redis.peek(flaky.id) is None
    done = read(flaky.id)
    assert (done.status, done.return_value, done.attempts) == (TaskResultStatus.SUCCESSFUL, 2, 2)
    assert Job.objects.get(pk=flaky.id).backend == "redis"  # the completed record, in the database

    doomed = t.doomed.using(backend="redis").enqueue("x")
    drain(worker("redis"))
    assert redis.peek(doomed.id) is None  # in Redis' failed set: not live
    assert read(doomed.id).status == TaskResultStatus.FAILED
    with pytest.raises(TaskResultDoesNotExist):
        read("e" * 32)


def test_peek_is_not_supported_by_default():
    assert get_backend("default").peek("a" * 32) is None


# -- conformance with Django's contract ---------------------------------------------------------


@DBS
def test_get_result_equals_the_result_enqueue_returned(backend):
    with tasks_on(backend):
        plain_result = t.add.using(backend="t").enqueue(2, y=3)
        assert task_backends["t"].get_result(plain_result.id) == plain_result
        tuned = t.flaky.using(backend="t", max_retries=5, timeout=12.5, priority=3).enqueue(fail_times=0)
        assert task_backends["t"].get_result(tuned.id) == tuned
        assert (tuned.task.max_retries, tuned.task.timeout, tuned.task.backoff) == (5, 12.5, {"strategy": "none"})


@pytest.mark.django_db
def test_a_task_argument_json_cannot_hold_is_a_type_error_naming_the_argument():
    with pytest.raises(TypeError, match=r"tests\.testapp\.tasks\.add\(\): argument 'x' \(a datetime\)") as refused:
        t.add.enqueue(timezone.now())
    assert isinstance(refused.value, InvalidPayload)  # still caught as before, and a ValueError
    assert isinstance(refused.value, ValueError)
    with pytest.raises(TypeError, match=r"argument 'args\[1\]' \(a set\)"):
        t.echo.enqueue(1, {2})
    with pytest.raises(TypeError, match=r"argument 'key' is not JSON-serialisable: key\['a'\] is nan"):
        t.echo.enqueue(key={"a": float("nan")})
    with pytest.raises(TypeError, match=r"scripted\(\): argument 'action' \(a datetime\)"):
        scripted.dispatch(action=timezone.now())  # a @job argument: the same error
    assert Job.objects.count() == 0


def test_check_says_so_when_django_jobs_is_not_an_installed_app():
    apps = [app for app in settings.INSTALLED_APPS if app != "django_jobs"]
    with tasks_on("default") as backend, override_settings(INSTALLED_APPS=apps):
        messages = backend.check()
    assert [m.id for m in messages] == ["django_jobs.T004"]
    assert "django_jobs" in messages[0].hint


@pytest.mark.django_db
def test_djangos_failure_log_line_carries_the_exception(caplog):
    result = t.doomed.using(max_retries=0).enqueue("the reason")
    with caplog.at_level("ERROR", logger=TASKS_LOGGER):
        drain(worker("default"))
    [record] = [r for r in caplog.records if r.name == TASKS_LOGGER and result.id in r.getMessage()]
    assert "state=FAILED" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is t.DoomedError
    assert "DoomedError: the reason" in caplog.text


ORDER_ENGINES = [
    pytest.param("default", id="database-sqlite", marks=pytest.mark.django_db),
    pytest.param("pg", id="database-postgresql", marks=pytest.mark.django_db(databases=["default", "postgres"])),
    pytest.param("redis", id="redis", marks=pytest.mark.django_db(transaction=True)),
]


@pytest.mark.parametrize("engine", ORDER_ENGINES)
def test_tasks_of_equal_priority_and_due_time_run_in_enqueue_order(engine, request):
    if engine == "redis":
        request.getfixturevalue("redis_backend")
    db = {"pg": "postgres"}.get(engine, "default")
    # One due time for all, ahead (Redis holds them in its delayed set): only the ids order them.
    due = timezone.now() + timedelta(seconds=0.5)
    results = [t.record.using(backend=engine, run_after=due).enqueue(f"fifo-{n}", db=db) for n in range(12)]
    assert [r.id for r in results] == sorted(r.id for r in results)  # time-ordered ids
    wait_until(lambda: timezone.now() > due, 5, "the due time")
    drain(QueueWorker(engine, ["default"], prefetch=1))
    ran = list(
        SideEffect.objects.using(db).filter(key__startswith="fifo-").order_by("id").values_list("key", flat=True)
    )
    assert ran == [f"fifo-{n}" for n in range(12)]
