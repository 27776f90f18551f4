"""Jobs that are coroutines: an ``async def`` ``@job``, a ``JOBS["HANDLERS"]`` class whose
``handle`` is async, a sync ``@job`` that returns a coroutine, an ``async def`` ``@task``. Each
runs to its end in the worker, or is interrupted inside by its timeout or its abort; the async
ORM works in it. Every backend runs them in tests/integration/test_conformance.py; here, the
database backend on SQLite."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection

from django_jobs import Jobs, current_job
from django_jobs.models import JobAttempt
from django_jobs.pipeline import JobContext
from django_jobs.testing import run_jobs
from django_jobs.worker import QueueWorker
from tests.api_support import row, runs
from tests.testapp import tasks as t
from tests.testapp.jobs import scripted_async, scripted_later

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

# The worker ``AbortsItself`` asks its heartbeat to beat, and what that job saw.
WORKER: dict[str, QueueWorker] = {}
SEEN: list[object] = []


class AbortsItself:
    """A ``JOBS["HANDLERS"]`` handler whose ``handle`` is async: asks to abort its own job, lets
    the heartbeat beat once (both through ``sync_to_async``), notes whether its context and
    ``current_job()`` say it was aborted, then sleeps until something interrupts it (noted too)."""

    async def handle(self, context: JobContext) -> str:
        await sync_to_async(Jobs.abort)(context.job_id)
        await sync_to_async(WORKER["worker"].heartbeat._beat)(context.lease, ())
        running = current_job()
        SEEN.append(context.aborted and running is context)
        try:
            await asyncio.sleep(30)
        except BaseException as exc:
            SEEN.append(type(exc).__name__)
            raise
        return "slept"


def unique(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def test_a_timeout_is_raised_inside_an_async_job_where_it_awaits_and_the_attempt_fails():
    key = unique()
    job_id = scripted_async.using(backend="default", timeout=0.2, max_retries=0).dispatch(
        action="sleep", seconds=30, key=key
    )

    result = QueueWorker("default").process_once()

    assert (result.status, result.job_id) == ("dead-lettered", job_id)
    assert (result.error or "").startswith("JobTimeout: attempt exceeded its 0.2s timeout")
    assert runs(key) == 1 and runs(f"{key}:interrupted:JobTimeout") == 1  # it saw JobTimeout inside
    assert row("default", job_id).status == "failed"


def test_an_async_handler_sees_its_abort_then_job_aborted_is_raised_inside_it_after_the_grace(settings):
    settings.JOBS = {**settings.JOBS, "HANDLERS": {"aborts-itself": f"{__name__}.AbortsItself"}, "ABORT_GRACE": 0.05}
    job_id = Jobs.define("aborts-itself", {}).max_retries(3).dispatch(backend="default")
    WORKER["worker"] = worker = QueueWorker("default")
    results: list[Any] = []
    SEEN.clear()
    try:
        worker.run(once=True, on_result=results.append)  # the loop: its alarm interrupts any job
    finally:
        WORKER.clear()

    assert SEEN == [True, "JobAborted"]
    [result] = results
    assert result.status == "cancelled" and type(result.exception).__name__ == "JobAborted"
    assert row("default", job_id).status == "cancelled"
    [attempt] = JobAttempt.objects.filter(job_id=job_id)
    assert (attempt.outcome, attempt.error_class) == ("cancelled", "django_jobs.exceptions.JobAborted")


def test_run_jobs_runs_an_async_job_on_the_tests_connection_and_it_reads_current_job():
    key = unique()
    job_id = scripted_async.using(backend="default", keep_result=True).dispatch(action="whoami", key=key)

    [result] = run_jobs(backend="default")

    assert (result.status, result.job_id) == ("acked", job_id)
    assert row("default", job_id).result == f"{job_id}:1"
    # Its acreate() ran on this thread's connection, in the test's transaction: seen, uncommitted.
    assert runs(key) == 1 and connection.in_atomic_block


def test_from_async_code_run_jobs_through_sync_to_async_runs_an_async_job_on_the_tests_connection():
    key = unique()
    scripted_async.using(backend="default").dispatch(key=key)

    async def an_async_test() -> list[Any]:
        return await sync_to_async(run_jobs)(backend="default")

    [result] = async_to_sync(an_async_test)()

    assert result.status == "acked" and runs(key) == 1


def test_a_sync_job_that_returns_a_coroutine_has_it_run():
    key = unique()
    scripted_later.using(backend="default").dispatch(key=key)

    [result] = run_jobs(backend="default")

    assert result.status == "acked" and runs(key) == 1


@pytest.mark.django_db(transaction=True)
def test_the_sync_engine_with_raise_runs_an_async_job_at_dispatch_and_raises_its_error(settings):
    settings.JOBS = {**settings.JOBS, "BACKENDS": {"default": {"ENGINE": "sync", "OPTIONS": {"RAISE": True}}}}
    key = unique()
    scripted_async.dispatch(key=key)
    assert runs(key) == 1
    with pytest.raises(RuntimeError, match="scripted failure"):
        scripted_async.dispatch(action="raise", key=key)
    assert runs(key) == 2


def test_an_async_task_is_interrupted_inside_by_its_timeout_and_never_runs_on():
    key = unique()
    result = t.async_nap.using(backend="default").enqueue(key)

    worked = QueueWorker("default").process_once()

    assert worked.status == "dead-lettered" and (worked.error or "").startswith("JobTimeout: ")
    assert runs(f"{key}:JobTimeout") == 1 and runs(f"{key}:woke") == 0
    result.refresh()
    assert result.status == "FAILED"
