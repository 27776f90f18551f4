"""Structured logging: every record about a delivery carries the same attributes (``job_id``,
``queue``, ``handler``, ``attempt``, ``outcome``), so a JSON log formatter gets fields; the
words are the worker's (completed, retrying, deferred, failed, rejected)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import replace
from io import StringIO

import pytest
from django.core.management import call_command

from django_jobs import Jobs
from django_jobs.locks import CacheLock
from django_jobs.pipeline import LOG_FIELDS
from django_jobs.worker import QueueWorker
from tests.api_support import drain
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
