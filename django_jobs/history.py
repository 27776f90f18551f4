"""The attempt history: one ``JobAttempt`` row per finished attempt, newest ``HISTORY_LIMIT`` kept
(per round of attempts: an admin retry trims the history and starts a new round).

Written by the worker after it settled an attempt (just before, for a failed run's requeue where
the backend batches requeues: its retry is never claimable before the row exists), and by the
reaper for a lost one. Never raises: the attempt is already settled, and a history that cannot be
written is logged and counted (``jobs_history_errors``), not a reason to run the job again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import datetime
from typing import Any, TypedDict, Unpack

from django.db import connections, router
from django.utils import timezone

from . import conf, rows
from .metrics import get_collector
from .models import AttemptOutcome, JobAttempt

logger = logging.getLogger("django_jobs.history")

_worker: tuple[int, str] = (0, "")


def worker_id() -> str:
    """``host:pid`` of this process (recomputed after a fork)."""
    global _worker
    pid = os.getpid()
    if _worker[0] != pid:
        _worker = (pid, f"{socket.gethostname()[:80]}:{pid}")
    return _worker[1]


def error_class(exc: BaseException) -> str:
    """The dotted path of ``exc``'s class, as ``TaskError.exception_class_path`` wants it."""
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


class Details(TypedDict, total=False):
    """What an attempt's row may say besides its job, number and outcome."""

    started_at: datetime | None
    error: str
    error_class: str
    worker: str | None  # who ran it (``host:pid`` of this process when not given)


def record(job_id: str, attempt: int, outcome: str, *, using: str | None = None, **details: Unpack[Details]) -> None:
    """Keep one finished attempt of ``job_id`` (``outcome``: an :class:`AttemptOutcome`) and
    forget the ones beyond ``HISTORY_LIMIT``."""
    record_many([attempt_row(job_id, attempt, outcome, **details)], using)


def attempt_row(job_id: str, attempt: int, outcome: str, **details: Unpack[Details]) -> dict[str, Any]:
    """One finished attempt, as :func:`record_many` writes it (finished now)."""
    worker = details.get("worker")
    return {
        "job_id": job_id,
        "attempt": attempt,
        "outcome": outcome,
        "worker_id": worker_id() if worker is None else worker,
        "started_at": details.get("started_at"),
        "finished_at": timezone.now(),
        "error_class": details.get("error_class", "")[:255],
        "error": details.get("error", ""),
    }


def record_many(attempts: list[dict[str, Any]], using: str | None = None) -> None:
    """Keep finished attempts (:func:`attempt_row`), in one statement, and forget the ones
    beyond ``HISTORY_LIMIT`` of their jobs."""
    if not attempts:
        return
    try:
        limit = int(conf.get("HISTORY_LIMIT"))
        if limit <= 0:
            return
        db = using or router.db_for_write(JobAttempt)
        # A record of what happened, not queue state: on PostgreSQL it commits without waiting
        # for the disk (a database crash may lose its last moments, never a job).
        rows.insert_many(connections[db], JobAttempt, attempts, async_commit=True)
        for row in attempts:
            if row["attempt"] > limit:  # rare: a short history costs no extra statement
                JobAttempt.objects.using(db).filter(job_id=row["job_id"], attempt__lte=row["attempt"] - limit).delete()
    except Exception:
        get_collector().increment("jobs_history_errors", len(attempts))
        which = ", ".join(f"attempt {row['attempt']} of job {row['job_id']}" for row in attempts)
        logger.exception("could not record %s in its history", which)


def amend(row: dict[str, Any], using: str | None = None) -> None:
    """Write ``row`` (:func:`attempt_row`) over the newest ``retrying`` row of its attempt: a
    failed run's row is written before its requeue, which the backend may then refuse (the job
    was asked to abort), and the run ends cancelled instead, one row still. Inserted when there
    is no such row (its write failed)."""
    try:
        if int(conf.get("HISTORY_LIMIT")) <= 0:
            return
        attempts = JobAttempt.objects.using(using or router.db_for_write(JobAttempt))
        retrying = attempts.filter(job_id=row["job_id"], attempt=row["attempt"], outcome=AttemptOutcome.RETRYING)
        newest = retrying.order_by("-id").values_list("id", flat=True).first()
        if newest is not None:
            attempts.filter(id=newest).update(**{k: v for k, v in row.items() if k not in ("job_id", "attempt")})
            return
    except Exception:
        get_collector().increment("jobs_history_errors")
        logger.exception("could not record attempt %s of job %s in its history", row["attempt"], row["job_id"])
        return
    record_many([row], using)


class Deferred:
    """Attempt rows a worker keeps to write with its batch's next write, in one statement with
    the rows written after them: every write here goes in the order the rows were made (a lock
    held across it), so a job's attempts are recorded in order whichever thread writes."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using
        self._rows: list[dict[str, Any]] = []
        self._kept = threading.Lock()  # over ``_rows``
        self._writing = threading.Lock()  # over a write, kept rows first

    def __bool__(self) -> bool:
        return bool(self._rows)

    def later(self, row: dict[str, Any]) -> None:
        """Keep ``row`` (:func:`attempt_row`) for the next :meth:`write`."""
        with self._kept:
            self._rows.append(row)

    def write(self, rows: list[dict[str, Any]] | None = None) -> None:
        """Write the kept rows, then ``rows``, in one statement (:func:`record_many`), once the
        write under way in another thread, if any, has ended."""
        with self._writing:
            with self._kept:
                kept, self._rows = self._rows, []
            record_many(kept + rows if rows else kept, self.using)


def trim(job_id: str, using: str | None = None) -> None:
    """Keep only the newest ``HISTORY_LIMIT`` attempts of ``job_id``. An admin retry calls it:
    the attempt numbers start again at 1 after a retry, so ``record`` alone would not bound the
    history of a job retried again and again."""
    limit = max(int(conf.get("HISTORY_LIMIT")), 0)
    attempts = JobAttempt.objects.using(using or router.db_for_write(JobAttempt)).filter(job_id=job_id)
    stale = list(attempts.order_by("-id").values_list("id", flat=True)[limit:])
    if stale:
        attempts.filter(id__in=stale).delete()


def attempts_of(job_id: str, using: str | None = None) -> list[JobAttempt]:
    """The kept attempts of ``job_id``, oldest first (in the order they were recorded: the
    numbering starts again at 1 after an admin retry)."""
    db = using or router.db_for_read(JobAttempt)
    return list(JobAttempt.objects.using(db).filter(job_id=job_id).order_by("id"))
