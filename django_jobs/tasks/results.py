"""A task's job, as storage knows it, read into Django's ``TaskResult``: its state, its
attempt history (errors, workers, start times) and what it returned."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import router
from django.utils import timezone

from .. import conf
from ..envelope import Envelope
from .compat import TaskError, TaskResult, TaskResultStatus
from .payload import JOB_OPTIONS, TaskPayload

if TYPE_CHECKING:
    from ..models import Job, JobAttempt

# A finished job whose last attempt is not in the attempt history yet is still being recorded
# by its worker (the settle comes first, the history right after): it is reported as running
# for at most this long, then as finished even if its history was never written.
HISTORY_GRACE = timedelta(seconds=10)
# A job on a backend with live state of its own (Redis) is, for a moment between its final
# settle there and its record in the database, in neither: a lookup that finds nothing looks
# again for this long before it answers that the result does not exist.
RECORD_WAIT = 1.0
RECORD_POLL = 0.02

_STATUS = {
    "waiting": TaskResultStatus.READY,  # waiting for the jobs it depends on
    "pending": TaskResultStatus.READY,  # waiting for its first run, or for a retry
    "in_progress": TaskResultStatus.RUNNING,
    "completed": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    # Cancelled by an operator before it ran: django.tasks has no such status, and the task
    # will not run (unless retried), so it reads as failed, finished when it was cancelled.
    "cancelled": TaskResultStatus.FAILED,
}


@dataclass(frozen=True, slots=True)
class Record:
    """One job as storage (or the worker running it) knows it."""

    envelope: Envelope  # its message: handler, payload, queue, priority, options
    state: str  # a JobStatus value
    attempts: int  # runs counted so far, the one in progress excluded
    finished_at: datetime | None = None
    claimed_at: datetime | None = None  # when the attempt in progress started, where known
    result: Any = None  # what it returned, once completed

    @classmethod
    def of_row(cls, row: Job) -> Record:
        from ..models import envelope_of

        envelope = replace(envelope_of(row), attempts=row.attempts)
        claimed = row.updated_at if row.status == "in_progress" else None  # the claim sets it
        return cls(envelope, row.status, row.attempts, row.finished_at, claimed, row.result)


@dataclass(frozen=True, slots=True)
class AttemptLog:
    """The attempt history of a job's current round of attempts, by attempt number."""

    by_number: dict[int, JobAttempt]

    @classmethod
    def read(cls, job_id: str, using: str | None) -> AttemptLog:
        from ..models import JobAttempt

        db = using or router.db_for_write(JobAttempt)  # where the worker writes it: no replica lag
        rows = list(JobAttempt.objects.using(db).filter(job_id=job_id).order_by("id"))
        # An admin retry starts the numbering again at 1 and keeps the earlier attempts: the
        # current round starts at the newest attempt 1 (or the oldest kept, once trimmed).
        start = max((i for i, row in enumerate(rows) if row.attempt == 1), default=0)
        return cls({row.attempt: row for row in rows[start:]})

    def worker_ids(self, attempts: int) -> list[str]:
        """One per attempt 1..``attempts``: ``host:pid``, or ``""`` when not known (a lost run,
        or an attempt no longer or not yet in the history)."""
        return [row.worker_id if (row := self.by_number.get(n)) else "" for n in range(1, attempts + 1)]

    def errors(self, attempts: int) -> list[Any]:
        """One ``TaskError`` per failed (or lost) attempt among 1..``attempts``."""
        rows = [self.by_number[n] for n in range(1, attempts + 1) if n in self.by_number]
        return [
            TaskError(exception_class_path=row.error_class or "builtins.Exception", traceback=row.error)
            for row in rows
            if row.outcome != "completed"
        ]

    def starts(self, attempts: int) -> list[datetime]:
        """When attempts 1..``attempts`` started, where known (lost runs are not)."""
        rows = (self.by_number.get(n) for n in range(1, attempts + 1))
        return [row.started_at for row in rows if row is not None and row.started_at is not None]


def result_of(
    task: Any, record: Record, history_alias: str | None, *, final: bool = False, current_worker: str = ""
) -> Any:
    """The ``TaskResult`` of ``record``, with its attempt history (read from ``history_alias``,
    else where the router writes it). ``final``: the caller knows the job has finished.
    ``current_worker``: the attempt in progress runs in this process (``host:pid``), which
    starts it now."""
    # A job that has not run has no attempts to read (an admin retry's earlier ones are not counted).
    log = AttemptLog.read(record.envelope.id, history_alias) if record.attempts else AttemptLog({})
    state, recorded = record.state, record.attempts
    if state in ("completed", "failed") and not (final or _recorded(record, log)):
        state, recorded = "in_progress", record.attempts - 1  # its worker is still recording it
    running = state == "in_progress"
    status = _STATUS[state]
    starts = log.starts(recorded)
    attempt_start = record.claimed_at if running else None
    payload = TaskPayload.of(record.envelope.payload)
    result = new_result(
        _recorded_task(task, record.envelope, payload),
        record.envelope.id,
        status,
        payload,
        started_at=starts[0] if starts else attempt_start,
        last_attempted_at=attempt_start or (starts[-1] if starts else None),
        finished_at=record.finished_at if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
        errors=log.errors(recorded),
        worker_ids=log.worker_ids(recorded) + ([current_worker] if running else []),
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", record.result)
    return result


def new_result(
    task: Any,
    job_id: str,
    status: Any,
    payload: TaskPayload,
    *,
    started_at: datetime | None = None,
    last_attempted_at: datetime | None = None,
    finished_at: datetime | None = None,
    errors: list[Any] | None = None,
    worker_ids: list[str] | None = None,
) -> Any:
    """A ``TaskResult`` of ``task`` sent as job ``job_id`` with ``payload``."""
    return TaskResult(
        task=task,
        id=job_id,
        status=status,
        enqueued_at=payload.enqueued_at,
        started_at=started_at,
        last_attempted_at=last_attempted_at,
        finished_at=finished_at,
        args=payload.args,
        kwargs=payload.kwargs,
        backend=payload.backend,
        errors=errors or [],
        worker_ids=worker_ids or [],
    )


def record_waits(patient: bool) -> Iterator[float]:
    """Yields once, or (``patient``) until ``RECORD_WAIT`` seconds passed, pausing between."""
    start = time.monotonic()
    yield 0.0
    while patient and time.monotonic() - start < RECORD_WAIT:
        time.sleep(RECORD_POLL)
        yield time.monotonic() - start


def _recorded(record: Record, log: AttemptLog) -> bool:
    """Has the worker recorded the last attempt of this finished job in the history yet?"""
    return (
        record.attempts == 0  # it never ran (its idempotency key had succeeded before)
        or record.attempts in log.by_number
        or int(conf.get("HISTORY_LIMIT")) <= 0
        or (record.finished_at is not None and timezone.now() - record.finished_at > HISTORY_GRACE)
    )


def _recorded_task(task: Any, envelope: Envelope, payload: TaskPayload) -> Any:
    """``task`` as this job was enqueued: its queue, priority, backend, ``run_after`` and the job
    options it set (one it left to the ``JOBS`` defaults stays ``None``, so the result equals
    the one ``enqueue()`` returned). Not validated again (settings may have changed since), so
    it is built field by field."""
    changes = {
        "queue_name": envelope.queue,
        "priority": envelope.priority,
        "backend": payload.backend,
        "run_after": payload.run_after,
        **{name: payload.options.get(name) for name in JOB_OPTIONS},
    }
    copy = object.__new__(type(task))
    for f in fields(task):
        object.__setattr__(copy, f.name, changes.get(f.name, getattr(task, f.name)))
    return copy
