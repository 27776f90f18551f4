"""Structured logging: every record about a job carries the same attributes (``job_id``,
``queue``, ``handler``, ``attempt``, ``outcome``), so a JSON log formatter gets fields; the
words are the worker's (completed, retrying, deferred, skipped, failed, rejected, lost). The
worker's records, and those of the reaper, the heartbeat and the supervisor, all have them."""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from io import StringIO
from types import SimpleNamespace

import pytest
from django.core.management import call_command
from django.utils import timezone

from django_jobs import Jobs, pool
from django_jobs.backends.base import Lease
from django_jobs.heartbeat import Heartbeat
from django_jobs.locks import CacheLock
from django_jobs.logfields import LOG_FIELDS
from django_jobs.models import Job
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.api_support import drain
from tests.fake_servicebus import SDK_INSTALLED, FakeNamespace
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]
HANDLER = "tests.testapp.jobs.scripted"


class Capture(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def about(self, job_id: str) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "job_id", None) == job_id]

    def saying(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]


@pytest.fixture
def captured() -> Iterator[Capture]:
    """A handler on the ``django_jobs`` logger, which lets INFO through for the test."""
    logger = logging.getLogger("django_jobs")
    capture, level = Capture(), logger.level
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    try:
        yield capture
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)


def fields(record: logging.LogRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in LOG_FIELDS}


def test_a_completed_delivery_logs_its_fields(captured):
    job_id = scripted.dispatch(action="ok")
    drain(QueueWorker("default", ["default"]))

    [record] = captured.about(job_id)
    assert record.levelno == logging.INFO and "completed" in record.getMessage()
    assert fields(record) == {
        "job_id": job_id,
        "queue": "default",
        "handler": HANDLER,
        "attempt": 1,
        "outcome": "completed",
    }


def test_a_retried_then_failed_job_logs_each_run(captured):
    job_id = scripted.using(max_retries=1, backoff={"strategy": "fixed", "base": 0, "jitter": False}).dispatch(
        action="raise"
    )
    drain(QueueWorker("default", ["default"]))

    retried, failed = captured.about(job_id)
    assert fields(retried) == {**fields(failed), "attempt": 1, "outcome": "retrying"}
    assert retried.levelno == logging.INFO and "RuntimeError: scripted failure" in retried.getMessage()
    assert fields(failed) == {
        "job_id": job_id,
        "queue": "default",
        "handler": HANDLER,
        "attempt": 2,
        "outcome": "failed",
    }
    assert failed.levelno == logging.ERROR and "failed permanently after 2 run(s)" in failed.getMessage()
    assert failed.last_error.startswith("RuntimeError: scripted failure\nTraceback")


def test_a_rejected_message_logs_its_fields(captured):
    signed = scripted.builder(action="ok").build()
    Jobs.backend("default").enqueue(replace(signed, payload={"args": [], "kwargs": {"action": "raise"}}))

    [result] = drain(QueueWorker("default", ["default"]))

    assert result.status == "rejected"
    [record] = captured.about(signed.id)
    assert record.levelno == logging.ERROR and "rejected: BadSignature" in record.getMessage()
    assert fields(record) == {
        "job_id": signed.id,
        "queue": "default",
        "handler": HANDLER,  # what the message claims: it is logged, never run
        "attempt": None,
        "outcome": "rejected",
    }


def test_a_job_held_back_by_its_single_instance_lock_is_deferred_not_retrying(captured):
    assert CacheLock(f"django_jobs:single:{HANDLER}", "another-delivery", 60).acquire()
    job_id = scripted.using(single_instance=True).dispatch(action="ok")

    result = QueueWorker("default", ["default"]).process_once()

    assert (result.status, result.label) == ("requeued", "deferred")
    [record] = captured.about(job_id)
    assert fields(record)["outcome"] == "deferred" and "deferred" in record.getMessage()


def test_jobs_work_at_verbosity_0_prints_no_job_lines_but_still_logs(captured):
    job_id = scripted.dispatch(action="ok")
    out = StringIO()

    call_command("jobs_work", "--once", verbosity=0, stdout=out)

    assert [line for line in out.getvalue().splitlines() if not line.startswith("django-jobs worker started")] == []
    assert [fields(r)["outcome"] for r in captured.about(job_id)] == ["completed"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_rejection_shows_once_on_a_workers_terminal_and_stays_in_other_logs():
    signed = scripted.builder(action="ok").build()
    Jobs.backend("default").enqueue(replace(signed, payload={"args": [], "kwargs": {"action": "raise"}}))
    logger = logging.getLogger("django_jobs")
    terminal, file = logging.StreamHandler(Terminal()), logging.StreamHandler(StringIO())
    logger.addHandler(terminal)
    logger.addHandler(file)
    out = StringIO()
    try:
        call_command("jobs_work", "--once", stdout=out)
    finally:
        logger.removeHandler(terminal)
        logger.removeHandler(file)

    assert [line.split()[:2] for line in out.getvalue().splitlines()[1:-1]] == [["rejected", signed.id]]
    assert signed.id not in terminal.stream.getvalue()  # the worker's line is all the terminal shows
    assert f"message {signed.id} on queue default rejected: BadSignature" in file.stream.getvalue()
    assert terminal.filters == []  # the handler is left as it was


# -- the reaper, the heartbeat and the supervisor ------------------------------------------------------


def expired_lease(**options: object) -> Lease:
    """A job leased by a worker that stalled: its lease has run out, nobody reaped it yet."""
    job_id = scripted.using(**options).dispatch(action="ok")
    lease = Jobs.backend("default").fetch("default")
    assert lease is not None and lease.envelope is not None and lease.envelope.id == job_id
    Job.objects.filter(pk=job_id).update(leased_until=timezone.now() - timedelta(seconds=1))
    return lease


def test_the_reapers_record_says_how_many_leases_of_which_queue_were_lost(captured):
    expired_lease(max_retries=1)

    assert Reaper("default", ["default"]).reap_once() == 1

    [record] = captured.saying("reaped 1 expired lease(s) on default")
    assert record.levelno == logging.WARNING
    assert fields(record) == {"job_id": None, "queue": "default", "handler": None, "attempt": None, "outcome": "lost"}


@pytest.mark.parametrize(
    ("max_retries", "outcome", "level", "text"),
    [(1, "retrying", logging.WARNING, "lost, retrying in "), (0, "failed", logging.ERROR, "lost, failed permanently")],
)
def test_each_job_the_reaper_recovers_is_logged_with_its_fields(captured, max_retries, outcome, level, text):
    lease = expired_lease(max_retries=max_retries)

    assert Reaper("default", ["default"]).reap_once() == 1

    [record] = captured.saying(text)
    assert record.levelno == level and lease.envelope.id in record.getMessage()
    assert fields(record) == {
        "job_id": lease.envelope.id,
        "queue": "default",
        "handler": HANDLER,
        "attempt": 1,
        "outcome": outcome,
    }


def test_the_heartbeat_of_a_reaped_lease_logs_it_lost(captured):
    lease = expired_lease(max_retries=1)
    Reaper("default", ["default"]).reap_once()
    beat = Heartbeat(Jobs.backend("default"), lease_seconds=30)
    beat.watch(lease)

    beat._beat(lease, ())  # one beat, on this thread

    assert beat.lost(lease)
    [record] = captured.saying("lease lost while running")
    assert fields(record) == {
        "job_id": lease.envelope.id,
        "queue": "default",
        "handler": HANDLER,
        "attempt": None,  # the heartbeat does not know the run's number
        "outcome": "lost",
    }


def lose_runs(namespace: FakeNamespace, times: int) -> None:
    """``times`` Service Bus deliveries whose worker died: each is fetched, its lock runs out."""
    for _ in range(times):
        assert Jobs.backend("servicebus").fetch("default") is not None
        namespace.advance(namespace.lock_seconds() + 1)


WAIT_120 = {"strategy": "fixed", "base": 120, "jitter": False}
NO_WAIT = {"strategy": "none"}


@pytest.mark.parametrize(
    ("max_retries", "backoff", "lost", "outcome", "level", "text"),
    [
        (3, WAIT_120, 1, "retrying", logging.WARNING, "lost, retrying in 120s: WorkerLost"),
        (1, NO_WAIT, 2, "failed", logging.ERROR, "failed permanently after 2 run(s): WorkerLost"),
    ],
)
@pytest.mark.skipif(not SDK_INSTALLED, reason="azure-servicebus is not installed")
def test_a_brokers_lost_run_is_logged_retrying_or_failed(
    captured, servicebus_fake, max_retries, backoff, lost, outcome, level, text
):
    env = scripted.using(backend="servicebus", max_retries=max_retries, backoff=backoff).builder(action="ok").build()
    Jobs.backend("servicebus").enqueue(env)  # at once: a dispatch waits for the test's transaction
    lose_runs(servicebus_fake, lost)

    assert Jobs.backend("servicebus").fetch("default") is None  # settled at fetch: never handed out

    records = captured.about(env.id)
    assert len(records) == lost  # each lost run is logged once, when the broker's count shows it
    record = records[-1]
    assert record.levelno == level and text in record.getMessage()
    assert fields(record) == {
        "job_id": env.id,
        "queue": "default",
        "handler": HANDLER,
        "attempt": lost,
        "outcome": outcome,
    }
    if outcome == "failed":
        assert record.last_error.startswith("WorkerLost: its Service Bus lock expired 2 time(s)")


class DiesHoldingAJob:
    """A worker process whose job kills it: it tells the supervisor of the job in hand, then exits."""

    def __init__(self, lease: Lease) -> None:
        self.lease, self.supervisor, self.exit_on_hard_timeout = lease, None, False

    def stop(self) -> None:
        pass

    def run(self, **options: object) -> None:
        self.supervisor.in_hand(self.lease, True)
        os._exit(3)


def test_the_supervisor_logs_a_dead_worker_process_with_the_job_it_lost(captured, monkeypatch):
    # The forked process touches no database, and its supervisor needs not close this test's.
    monkeypatch.setattr(pool, "connections", SimpleNamespace(close_all=lambda: None, all=list))
    monkeypatch.setattr(pool, "Presence", lambda worker: nullcontext())
    monkeypatch.setattr(pool, "time", SimpleNamespace(monotonic=time.monotonic, sleep=lambda seconds: None))
    env = scripted.builder(action="exit").build()
    lease = Lease(token="broker-7", owner_token="owner-1", expires_at=timezone.now(), queue="default", envelope=env)
    recovered = []

    def recover(queue: str, owner: str, counted: list[str], succeeded: tuple[str, ...]) -> None:
        recovered.append((queue, owner, counted, succeeded))
        supervisor.stopping = True  # not replaced: the run ends

    supervisor = pool.WorkerPool(lambda: DiesHoldingAJob(lease), recover=recover)

    assert supervisor.run() == 0

    assert recovered == [("default", "owner-1", ["broker-7"], ())]
    [record] = captured.saying("died with status 3")
    assert fields(record) == {"job_id": env.id, "queue": "default", "handler": None, "attempt": None, "outcome": "lost"}
