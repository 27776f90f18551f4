"""``django.tasks`` as Django's documentation uses it, with every task run by a
``manage.py jobs_work`` process and every result read from this one: on the database backend
(SQLite and PostgreSQL) and on Redis.

The tasks are ``tests/testapp/tasks.py``; its receivers note each ``task_started`` and
``task_finished`` the worker sends as a ``SideEffect`` row, in the database the task's job is
recorded in, so this process can see them.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_jobs.history import attempts_of
from django_jobs.tasks import TaskResultStatus
from tests.procs import processes, wait_until, worker_env
from tests.testapp import tasks as t
from tests.testapp.models import SideEffect

try:
    from django.tasks.signals import task_enqueued
except ImportError:  # Django 5.2: the backport
    from django_tasks.signals import task_enqueued

pytestmark = pytest.mark.slow

# The TASKS aliases of tests/settings.py, each enqueuing on the JOBS backend of the same name.
ENGINES = [
    pytest.param("default", id="database-sqlite", marks=pytest.mark.django_db(transaction=True)),
    pytest.param(
        "pg",
        id="database-postgresql",
        marks=[pytest.mark.postgres, pytest.mark.django_db(databases=["default", "postgres"], transaction=True)],
    ),
    pytest.param("redis", id="redis", marks=pytest.mark.django_db(transaction=True)),
]
# Where each engine's jobs, attempt history and signal notes are recorded.
RECORDS_DB = {"default": "default", "pg": "postgres", "redis": "default"}
FINISH_TIMEOUT = 60


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name == "pg":
        request.getfixturevalue("postgres_up")
    if name == "redis":
        request.getfixturevalue("redis_up")
    return name


def finished(*results: Any) -> bool:
    for result in results:
        result.refresh()
    return all(result.is_finished for result in results)


def notes(kind: str, result: Any, engine: str) -> list[tuple[str, int, int]]:
    """``(status:errors, attempts, pid)`` of each ``kind`` signal the worker sent for ``result``."""
    rows = SideEffect.objects.using(RECORDS_DB[engine]).filter(key__startswith=f"{kind}:{result.id}:").order_by("id")
    return [(row.key.split(":", 2)[2], row.attempt, row.pid) for row in rows]


def test_enqueue_retries_errors_context_and_async_with_results_read_from_another_process(engine):
    enqueued: list[Any] = []
    task_enqueued.connect(receiver := lambda sender, task_result, **kw: enqueued.append(task_result))
    try:
        with processes() as procs:
            worker = procs.worker("--backend", engine, env=worker_env())
            ok = t.add.using(backend=engine).enqueue(2, y=3)
            flaky = t.flaky.using(backend=engine).enqueue(fail_times=2)
            doomed = t.doomed.using(backend=engine).enqueue("no luck")
            both = t.async_add.using(backend=engine).enqueue(20, 22)
            assert {r.status for r in (ok, flaky, doomed, both)} == {TaskResultStatus.READY}
            wait_until(lambda: finished(ok, flaky, doomed, both), FINISH_TIMEOUT, "four finished tasks")
            assert worker.stop() == 0, worker.output()
    finally:
        task_enqueued.disconnect(receiver)
    assert [r.id for r in enqueued] == [ok.id, flaky.id, doomed.id, both.id]

    assert (ok.status, ok.return_value, ok.errors) == (TaskResultStatus.SUCCESSFUL, 5, [])
    assert both.return_value == 42
    worker_id = ok.worker_ids[0]
    pid = int(worker_id.rpartition(":")[2])
    assert pid not in (0, os.getpid())  # the worker process ran it
    assert ok.enqueued_at <= ok.started_at <= ok.finished_at

    # Two failed attempts, then a success: TaskContext.attempt counted 1, 2, 3.
    assert (flaky.status, flaky.return_value, flaky.attempts) == (TaskResultStatus.SUCCESSFUL, 3, 3)
    assert flaky.worker_ids == [worker_id] * 3
    assert [e.exception_class for e in flaky.errors] == [t.FlakyError] * 2
    assert ["attempt 1 failed" in flaky.errors[0].traceback, "attempt 2 failed" in flaky.errors[1].traceback] == [
        True,
        True,
    ]
    assert flaky.started_at < flaky.last_attempted_at < flaky.finished_at

    assert (doomed.status, doomed.attempts) == (TaskResultStatus.FAILED, 2)
    assert [e.exception_class_path for e in doomed.errors] == ["tests.testapp.tasks.DoomedError"] * 2
    with pytest.raises(ValueError, match="failed"):
        _ = doomed.return_value

    # task_started before each attempt; task_finished once, with the final status.
    assert notes("started", flaky, engine) == [("RUNNING:0", 1, pid), ("RUNNING:1", 2, pid), ("RUNNING:2", 3, pid)]
    assert notes("finished", flaky, engine) == [("SUCCESSFUL:2", 3, pid)]
    assert notes("started", doomed, engine) == [("RUNNING:0", 1, pid), ("RUNNING:1", 2, pid)]
    assert notes("finished", doomed, engine) == [("FAILED:2", 2, pid)]


def test_a_running_task_reads_as_running_until_it_returns(engine):
    key, db = f"hold-{uuid.uuid4().hex[:12]}", RECORDS_DB[engine]
    with processes() as procs:
        worker = procs.worker("--backend", engine, env=worker_env())
        result = t.hold.using(backend=engine).enqueue(key, db=db)
        wait_until(lambda: SideEffect.objects.using(db).filter(key=f"{key}:started").exists(), 30, "the task to start")
        result.refresh()
        assert (result.status, result.attempts, result.is_finished) == (TaskResultStatus.RUNNING, 1, False)
        with pytest.raises(ValueError, match="not finished"):
            _ = result.return_value
        SideEffect.objects.using(db).create(key=f"{key}:go")
        wait_until(lambda: finished(result), FINISH_TIMEOUT, "the released task")
        assert worker.stop() == 0, worker.output()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "released")


def test_priority_orders_waiting_tasks_and_run_after_defers_one(engine):
    prefix, db = f"prio-{uuid.uuid4().hex[:12]}", RECORDS_DB[engine]
    run_after = timezone.now() + timedelta(seconds=2)
    deferred = t.record.using(backend=engine, run_after=run_after).enqueue(f"{prefix}-deferred", db=db)
    waiting = [
        t.record.using(backend=engine, priority=priority).enqueue(f"{prefix}-{priority}", db=db)
        for priority in (-10, 50, 0)
    ]
    with processes() as procs:
        worker = procs.worker("--backend", engine, env=worker_env())
        wait_until(lambda: finished(deferred, *waiting), FINISH_TIMEOUT, "four finished tasks")
        assert worker.stop() == 0, worker.output()
    ran = SideEffect.objects.using(db).filter(key__startswith=prefix).order_by("id").values_list("key", flat=True)
    assert [k for k in ran if not k.endswith("deferred")] == [f"{prefix}-50", f"{prefix}-0", f"{prefix}--10"]
    assert deferred.status == TaskResultStatus.SUCCESSFUL
    assert deferred.task.run_after == run_after
    # Redis keeps due times in whole milliseconds.
    assert deferred.started_at >= run_after.replace(microsecond=run_after.microsecond // 1000 * 1000)


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(
            "pg",
            id="database-postgresql",
            marks=[pytest.mark.postgres, pytest.mark.django_db(databases=["default", "postgres"], transaction=True)],
        ),
        pytest.param("redis", id="redis", marks=pytest.mark.django_db(transaction=True)),
    ],
    indirect=True,
)
def test_fast_failures_retried_at_once_by_two_processes_see_every_earlier_attempt(engine):
    """A task that fails within microseconds of its start, its retries due at once (backoff
    "none"), run by two worker processes that batch their writes: each retry starts only once
    the row of the run before it is written, whichever process ran that one, so each
    ``task_started`` sees every earlier error and the history lists the attempts in order."""
    with processes() as procs:
        worker = procs.worker("--backend", engine, "--concurrency", "2", env=worker_env())
        results = [t.flaky.using(backend=engine).enqueue(fail_times=3) for _ in range(8)]
        wait_until(lambda: finished(*results), FINISH_TIMEOUT, "eight finished tasks")
        assert worker.stop() == 0, worker.output()
    db = RECORDS_DB[engine]
    for result in results:
        assert (result.status, result.attempts, len(result.errors)) == (TaskResultStatus.SUCCESSFUL, 4, 3)
        started = [(status, attempt) for status, attempt, _ in notes("started", result, engine)]
        assert started == [(f"RUNNING:{n}", n + 1) for n in range(4)], started
        assert [a.attempt for a in attempts_of(result.id, using=db)] == [1, 2, 3, 4]
