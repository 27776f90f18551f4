"""Helpers for testing code that dispatches jobs.

:func:`run_jobs` runs the jobs waiting in a backend's queues in the calling process, through the
worker's own delivery pipeline (signature check, handler allowlist, guards, retry decision,
settle), on the caller's database connection: in a ``TestCase`` or a ``django_db`` test it sees
the rows the test has not committed. It starts no thread (but an ``async def`` job's event loop,
whose async ORM calls still run here) and forks no process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, cast

from django.db.models import F, Min
from django.utils import timezone

from . import conf
from .backends.base import QueueBackend
from .backends.database import DatabaseBackend
from .exceptions import JobsError, UnknownQueue
from .models import Job, JobStatus
from .pipeline import Outcome, WorkerResult
from .worker import QueueWorker

if TYPE_CHECKING:
    from .backends.redis import RedisBackend

__all__ = ["run_jobs"]


def run_jobs(
    queue: str | Sequence[str] | None = None,
    backend: str | QueueBackend | None = None,
    max: int | None = None,
    *,
    include_delayed: bool = False,
) -> list[WorkerResult]:
    """Run the ready jobs of ``queue`` here and now, until none is ready or ``max`` ran.

    ``queue``: a queue or a list of them, tried in that order before every fetch (``None``:
    every queue of ``JOBS["QUEUES"]``). ``backend``: a backend name or instance (``None``: the
    default backend). ``max``: stop after that many deliveries.

    A failed run with retries left is requeued after its backoff, so it is not ready again at
    once. With ``include_delayed=True``, whenever no job is ready the delayed jobs are brought
    forward as if the clock jumped to the earliest one's due time: retries and ``delay``/
    ``scheduled_at`` jobs run too, in the order they fall due (database and redis engines).

    Returns one :class:`~django_jobs.pipeline.WorkerResult` per delivery, in order. A job's own
    failure is in its result (``status``, ``error``, ``exception``); it is not raised.
    """
    if max is not None and max < 0:
        raise ValueError(f"max must not be negative, not {max!r}")
    queues = _queues(queue)
    worker = QueueWorker(backend, queues)
    results: list[WorkerResult] = []
    ran_since_jump = True  # a clock jump that runs nothing but busy deliveries ends the loop
    while max is None or len(results) < max:
        result = worker.process_once()
        if result.status is Outcome.EMPTY:
            if include_delayed and ran_since_jump and _jump_to_next_due(worker.backend, queues):
                ran_since_jump = False
                continue
            break
        results.append(result)
        if not (result.status is Outcome.REQUEUED and result.exception is None):
            ran_since_jump = True  # anything but a delivery that found its key or lock held, and waits
    return results


def _queues(queue: str | Sequence[str] | None) -> list[str]:
    known = conf.queues()
    if queue is None:
        return known
    names = [queue] if isinstance(queue, str) else list(queue)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UnknownQueue(f"queue(s) {', '.join(map(repr, unknown))} not in JOBS['QUEUES'] ({', '.join(known)})")
    return names


def _jump_to_next_due(backend: QueueBackend, queues: list[str]) -> bool:
    """Move every delayed job of ``queues`` earlier by the time until the first one is due, so
    that one is due now and the others keep their order and spacing. ``False``: none is delayed."""
    if isinstance(backend, DatabaseBackend):
        return _jump_database(backend, queues)
    redis_backend = sys.modules.get("django_jobs.backends.redis")  # only loaded when configured
    if redis_backend is not None and isinstance(backend, redis_backend.RedisBackend):
        return _jump_redis(cast("RedisBackend", backend), queues)
    raise JobsError(
        f"run_jobs(include_delayed=True) needs the database or redis engine; backend {backend.name!r} "
        f"is a {type(backend).__name__}"
    )


def _jump_database(backend: DatabaseBackend, queues: list[str]) -> bool:
    now = timezone.now()
    delayed = Job.objects.using(backend.alias).filter(status=JobStatus.PENDING, queue__in=queues, available_at__gt=now)
    earliest = delayed.aggregate(earliest=Min("available_at"))["earliest"]
    if earliest is None:
        return False
    shift: timedelta = earliest - now
    delayed.update(available_at=F("available_at") - shift)
    return True


def _jump_redis(backend: RedisBackend, queues: list[str]) -> bool:
    client, now_ms = backend.client, int(time.time() * 1000)  # whole ms, as the backend's own clock
    delayed = {q: client.zrangebyscore(backend.keys(q).delayed, f"({now_ms}", "+inf", withscores=True) for q in queues}
    scores = [score for members in delayed.values() for _, score in members]
    if not scores:
        return False
    shift = min(scores) - now_ms
    pipe = client.pipeline(transaction=False)  # queues may be in different cluster slots
    for q, members in delayed.items():
        if members:
            pipe.zadd(backend.keys(q).delayed, {job_id: score - shift for job_id, score in members}, xx=True)
    pipe.execute()
    return True
