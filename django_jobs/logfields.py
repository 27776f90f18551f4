"""The attributes every log record about a job carries, for JSON log formatters.

Each record about a job (a run, a settle, a reaped or lost lease, a worker process that died
with a job in hand) gets the same five attributes through ``extra``: ``job_id``, ``queue``,
``handler``, ``attempt`` and ``outcome`` (one of completed, retrying, deferred, skipped,
failed, rejected, lost), each ``None`` where it is not known. This module imports nothing of
the worker's, so every part of it can use it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .backends.base import Lease

LOG_FIELDS = ("job_id", "queue", "handler", "attempt", "outcome")


def log_fields(
    job_id: str | None,
    queue: str | None,
    handler: str | None = None,
    attempt: int | None = None,
    outcome: str | None = None,
) -> dict[str, Any]:
    """The ``extra`` of a log record about a job: every key of :data:`LOG_FIELDS`, ``None``
    where unknown, so a formatter finds the same attributes on every such record."""
    return {"job_id": job_id, "queue": queue, "handler": handler, "attempt": attempt, "outcome": outcome}


def lease_fields(lease: Lease, attempt: int | None = None, outcome: str | None = None) -> dict[str, Any]:
    """:func:`log_fields` of a fetched lease (its envelope's id and handler once decoded)."""
    env = lease.envelope
    job_id, handler = (lease.token, None) if env is None else (env.id, env.handler)
    return log_fields(job_id, lease.queue, handler, attempt, outcome)


def queues_fields(queues: Sequence[str]) -> dict[str, Any]:
    """:func:`log_fields` of a record about a worker or reaper rather than one job: no job,
    and the queue only when it serves exactly one."""
    return log_fields(None, queues[0] if len(queues) == 1 else None)


def debug_traceback(logger: logging.Logger, error: BaseException) -> BaseException | None:
    """What to pass as ``exc_info`` for an error a log line names already (``summary``): its
    traceback too only where ``logger`` shows DEBUG, so a flapping backend logs one line per
    failure, not a traceback."""
    return error if logger.isEnabledFor(logging.DEBUG) else None


def logged_try(failures: int) -> bool:
    """Of a run of failed tries that come soon after each other, log the 1st, 2nd, 4th, 8th ...:
    a few lines, however long the outage."""
    return failures & (failures - 1) == 0
