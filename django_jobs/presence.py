"""Worker presence: a worker process's ``Worker`` row and its deliveries per minute
(``Throughput``), written by one daemon thread every ``Worker.BEAT``.

The worker's hot path writes nothing: it keeps the job in hand and cumulative counts per queue
and outcome in memory (``QueueWorker.current`` and ``QueueWorker.tally``). Each beat reads them
and writes the row and the counts since the last written beat in one transaction. A beat that
fails (the database is down) changes nothing and is logged once per outage: its counts go with
the next beat that succeeds. Nothing here raises into the worker or holds it up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from django.db import DatabaseError, connections, router, transaction
from django.db.models import F
from django.utils import timezone

from .models import Throughput, Worker
from .pipeline import Outcome

if TYPE_CHECKING:
    from .worker import QueueWorker

logger = logging.getLogger("django_jobs.worker")

# What a process's start deletes: workers not seen for a week, throughput older than 8 days
# (the dashboard's longest window is a week).
KEEP_WORKERS = timedelta(days=7)
KEEP_THROUGHPUT = timedelta(days=8)
# The longest name of a job in hand the row holds (a broker's message may carry a longer one).
NAME_CHARS: int = Worker._meta.get_field("current_job_name").max_length or 255
# How long ``stop()`` waits for the last beat (it cannot hold up a stopping worker for long).
STOP_WAIT = 5.0
# How long after the start the first beat comes (or one beat's interval, if shorter): after the
# worker's first claim and first jobs, which its connection and writes would only slow down.
FIRST_BEAT = 0.5
# The ``Throughput`` column each outcome adds to; other outcomes count as processed only.
COLUMNS: dict[Outcome, str] = {
    Outcome.ACKED: "completed",
    Outcome.REQUEUED: "retried",
    Outcome.DEAD_LETTERED: "failed",
    Outcome.REJECTED: "rejected",
}


@dataclass(frozen=True)
class Beat:
    """One write: the worker's row as of a moment, and its counts since the last written beat."""

    worker_id: str
    backend: str
    identity: dict[str, Any]  # written when the row is created: hostname, pid, queues, started_at
    state: dict[str, Any]  # written every beat: last_seen, stopped_at, current job, processed
    minute: datetime
    counts: dict[str, dict[str, int]]  # queue -> Throughput column -> deliveries to add


def write_beat(alias: str, beat: Beat) -> None:
    """Write ``beat`` to database ``alias`` in one transaction: all of it, or nothing."""
    with transaction.atomic(using=alias):
        workers = Worker.objects.using(alias)
        if not workers.filter(pk=beat.worker_id).update(**beat.state):
            workers.create(id=beat.worker_id, backend=beat.backend, **beat.identity, **beat.state)
        # The process's own rows: no other writer shares them, so update-or-create is safe.
        for queue, counts in beat.counts.items():
            key = {"minute": beat.minute, "worker": beat.worker_id, "backend": beat.backend, "queue": queue}
            rows = Throughput.objects.using(alias)
            if not rows.filter(**key).update(**{column: F(column) + n for column, n in counts.items()}):
                rows.create(**key, **counts)


def prune(alias: str, now: datetime) -> None:
    """Delete the rows of workers long gone and throughput too old to be shown (both indexed),
    in one transaction: a reader never sees one pruned and not the other."""
    with transaction.atomic(using=alias):
        Worker.objects.using(alias).filter(last_seen__lt=now - KEEP_WORKERS).delete()
        Throughput.objects.using(alias).filter(minute__lt=now - KEEP_THROUGHPUT).delete()


def counts_since(
    sent: dict[tuple[str, Outcome], int], tally: dict[tuple[str, Outcome], int]
) -> dict[str, dict[str, int]]:
    """The ``Throughput`` columns to add, per queue, from two cumulative tallies."""
    counts: dict[str, dict[str, int]] = {}
    for (queue, outcome), total in tally.items():
        column = COLUMNS.get(outcome)
        added = total - sent.get((queue, outcome), 0)
        if column is not None and added:
            counts.setdefault(queue, {})[column] = added
    return counts


class Presence:
    """The presence of one worker process: ``start()`` after the fork, ``stop()`` when its run
    ends (or ``with Presence(worker):`` around the run)."""

    def __init__(
        self,
        worker: QueueWorker,
        *,
        interval: float | None = None,
        clock: Callable[[], datetime] = timezone.now,
    ) -> None:
        self.worker = worker
        self.clock = clock
        self.interval = Worker.BEAT.total_seconds() if interval is None else interval
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.id = f"{self.hostname[:80]}:{self.pid}:{secrets.token_hex(3)}"
        self.alias: str = router.db_for_write(Worker)
        self.started_at = clock()
        self._sent: dict[tuple[str, Outcome], int] = {}  # the tally as last written
        self._failing = False
        self._pruned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; its first beat, ``FIRST_BEAT`` later, writes the row (or the last
        one, of a process that stops sooner)."""
        self.started_at = self.clock()
        self._thread = threading.Thread(target=self._run, name=f"presence {self.id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Write a last beat with ``stopped_at`` (waiting up to ``STOP_WAIT``) and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def beat(self, *, stopping: bool = False) -> bool:
        """Write the row and the counts since the last written beat; ``False`` if that failed
        (nothing was written, and the counts go with the next beat)."""
        tally = dict(self.worker.tally)  # one copy: the worker's thread keeps counting meanwhile
        current = self.worker.current
        now = self.clock()
        beat = Beat(
            worker_id=self.id,
            backend=self.worker.backend.name,
            identity={
                "hostname": self.hostname,
                "pid": self.pid,
                "queues": list(self.worker.queues),
                "started_at": self.started_at,
            },
            state={
                "last_seen": now,
                "stopped_at": now if stopping else None,
                "current_job": current[0] if current else "",
                "current_job_name": current[2][:NAME_CHARS] if current else "",
                "current_job_started": now - timedelta(seconds=max(time.time() - current[1], 0.0)) if current else None,
                "processed": sum(tally.values()),
            },
            minute=now.replace(second=0, microsecond=0),
            counts=counts_since(self._sent, tally),
        )
        if not self._safely(lambda: write_beat(self.alias, beat)):
            return False
        self._sent = tally
        return True

    def _run(self) -> None:
        try:
            wait = min(FIRST_BEAT, self.interval)
            while not self._stop.wait(wait):
                self._tick()
                wait = self.interval
            self.beat(stopping=True)
        finally:
            with contextlib.suppress(DatabaseError):
                connections[self.alias].close()  # this thread's own connection

    def _tick(self) -> None:
        if self.beat() and not self._pruned:
            self._pruned = self._safely(lambda: prune(self.alias, self.clock()))
        # Kept between beats or closed, as CONN_MAX_AGE says; closed if broken.
        with contextlib.suppress(DatabaseError):
            connections[self.alias].close_if_unusable_or_obsolete()

    def _safely(self, write: Callable[[], None]) -> bool:
        """Run ``write``; a failure is logged once per outage, never raised."""
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - presence never breaks the worker
            if not self._failing:
                logger.warning(
                    "worker %s: could not write its presence to database %r (%s: %s); trying again every beat",
                    self.id,
                    self.alias,
                    type(exc).__name__,
                    exc,
                )
            self._failing = True
            return False
        if self._failing:
            logger.info("worker %s: presence written again", self.id)
        self._failing = False
        return True
