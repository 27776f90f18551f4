"""QueueWorker: the run loop around the delivery pipeline. It knows only the backend protocol.

Three parts, one concern each:

- :class:`~django_jobs.pipeline.DeliveryPipeline`: one lease through verify, guards, run, retry
  decision and settle, ending in one :class:`~django_jobs.pipeline.WorkerResult`;
- :class:`~django_jobs.heartbeat.Heartbeat`: the lease kept alive and the hard time limit,
  whatever the backend's health;
- :class:`QueueWorker` (here): fetching, the limits of a run (``--max``, ``--max-time``,
  ``--once``, stop), reaping, waiting for work and leasing the next job with an ack.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Protocol

from . import conf
from .backends import get_backend
from .backends.base import Lease, QueueBackend
from .heartbeat import Heartbeat
from .metrics import MetricsCollector, get_collector
from .pipeline import DeliveryPipeline, JobContext, Outcome, WorkerResult, format_error
from .reaper import Reaper

__all__ = ["JobContext", "Outcome", "QueueWorker", "WorkerResult", "format_error"]

logger = logging.getLogger("django_jobs.worker")

# Exit status of a worker process ended by a hard timeout (the supervisor restarts it).
EXIT_HARD_TIMEOUT = 75
# The longest pause between tries while the backend is unreachable.
MAX_OUTAGE_PAUSE = 30.0


class Budget(Protocol):
    """Tickets shared by the processes of a pool (:class:`~django_jobs.pool.SharedBudget`)."""

    def take(self) -> bool: ...

    def give_back(self) -> None: ...


class RunLimits:
    """What ends :meth:`QueueWorker.run`: ``max_jobs``, ``max_time`` and the budget a pool's
    processes share. A delivery takes a ticket before its fetch and gives it back when nothing
    came, so ``--max N`` across processes runs exactly N jobs."""

    def __init__(self, max_jobs: int | None, max_time: float | None, once: bool, budget: Budget | None) -> None:
        self.max_jobs, self.once, self.budget = max_jobs, once, budget
        self.deadline = time.monotonic() + max_time if max_time else None
        self.done = 0

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def admit(self, stopping: bool, *, ticket_held: bool = False) -> bool:
        """May one more delivery start? Takes its ticket unless it already holds one."""
        if stopping or self.out_of_time() or (self.max_jobs is not None and self.done >= self.max_jobs):
            return False
        return ticket_held or self.budget is None or self.budget.take()

    def admit_next(self, stopping: bool) -> bool:
        """While a job is acked: may the job after it be leased now? (It is ``done + 2``.)"""
        if self.once or (self.max_jobs is not None and self.done + 2 > self.max_jobs):
            return False
        return self.admit(stopping)

    def give_back(self) -> None:
        if self.budget is not None:
            self.budget.give_back()


class QueueWorker:
    """Processes jobs from ``queues`` of one backend, one attempt per delivery."""

    def __init__(
        self,
        backend: QueueBackend | str | None = None,
        queues: list[str] | None = None,
        *,
        metrics: MetricsCollector | None = None,
        exit_on_hard_timeout: bool = False,
        busy_delay: float = 1.0,
    ) -> None:
        self.backend = backend if isinstance(backend, QueueBackend) else get_backend(backend)
        self.queues = list(queues or [conf.default_queue()])
        self.metrics = metrics or get_collector()
        self.lease_seconds = float(conf.get("LEASE_TIMEOUT"))
        # True in a pool's worker process: a hard timeout ends the process (it cannot be
        # interrupted otherwise) and the supervisor starts a fresh one.
        self.exit_on_hard_timeout = exit_on_hard_timeout
        self.heartbeat = Heartbeat(self.backend, self.lease_seconds, self._after_hard_timeout)
        self.pipeline = DeliveryPipeline(
            self.backend, metrics=self.metrics, heartbeat=self.heartbeat, busy_delay=busy_delay
        )
        self.stopping = False
        self._ahead: Lease | None = None  # leased together with the last ack, not yet processed

    # -- one delivery --

    def process_once(self, queue: str | None = None) -> WorkerResult:
        """Fetch at most one message (from ``queue`` or each worker queue in order) and settle it."""
        lease = self._ahead
        if lease is not None and queue in (None, lease.queue):
            self._ahead = None
        else:
            lease = self._fetch(queue)
        return WorkerResult(Outcome.EMPTY) if lease is None else self.process(lease)

    def _fetch(self, queue: str | None) -> Lease | None:
        for name in (queue,) if queue else self.queues:
            lease = self.backend.fetch(name)
            if lease is not None:
                return lease
        return None

    def process(self, lease: Lease) -> WorkerResult:
        """Verify, run and settle one fetched lease. Never raises for a job's own failure."""
        return self.pipeline.process(lease)

    def _after_hard_timeout(self) -> None:
        if self.exit_on_hard_timeout:
            logging.shutdown()
            os._exit(EXIT_HARD_TIMEOUT)

    # -- the loop --

    def stop(self) -> None:
        """Ask ``run`` to return after the current job (safe to call from a signal handler)."""
        self.stopping = True

    def run(
        self,
        *,
        max_jobs: int | None = None,
        max_time: float | None = None,
        once: bool = False,
        sleep: float | None = None,
        budget: Budget | None = None,
        on_result: Callable[[WorkerResult], None] | None = None,
        reap: bool = True,
    ) -> int:
        """Process jobs until stopped, out of jobs (``once``), ``max_jobs`` or ``max_time``.

        ``budget`` is shared by the processes of a pool (``take()``/``give_back()``).
        Returns the number of deliveries processed.
        """
        sleep = conf.get("POLL_INTERVAL") if sleep is None else sleep
        limits = RunLimits(max_jobs, max_time, once, budget)
        reaper = Reaper(self.backend, self.queues) if reap else None
        if reaper is not None:
            reaper.metrics = self.metrics
            self.pipeline.on_backend_error = reaper.backend_failed
        next_reap = time.monotonic() if reaper else math.inf
        outages = 0
        if self.backend.pipelines_ack_fetch:
            self.pipeline.ack = lambda lease: self._ack_and_lease_next(lease, limits)
        self.heartbeat.start()
        try:
            while limits.admit(self.stopping, ticket_held=self._ahead is not None):
                if reaper is not None and time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + self.lease_seconds
                    self._reap(reaper)
                try:
                    result = self.process_once()
                except Exception:  # noqa: BLE001 - logged by _outage: the backend is unreachable
                    limits.give_back()
                    if reaper is not None:
                        reaper.backend_failed()
                    outages += 1
                    self._outage(outages, limits.deadline)
                    continue
                outages = 0
                if result.status is Outcome.EMPTY:
                    limits.give_back()
                    if once:
                        break
                    self._idle(sleep, limits.deadline)
                    continue
                limits.done += 1
                if on_result is not None:
                    on_result(result)
                if once:
                    break
        finally:
            self.pipeline.ack = self.backend.ack
            self.pipeline.on_backend_error = None
            if self._ahead is not None:
                self._release_ahead()
                limits.give_back()
            self.heartbeat.stop()
        return limits.done

    def _ack_and_lease_next(self, lease: Lease, limits: RunLimits) -> None:
        """Ack, and lease the next job in the same round trip when it will certainly run here."""
        if not limits.admit_next(self.stopping):
            return self.backend.ack(lease)
        try:
            # The first queue, as process_once would try first: priorities between queues hold.
            self._ahead = self.backend.ack_and_fetch(lease, self.queues[0])
        finally:
            if self._ahead is None:
                limits.give_back()  # nothing was leased ahead: return its ticket

    def _release_ahead(self) -> None:
        """A job leased ahead but not started goes straight back, not counted as a run."""
        lease, self._ahead = self._ahead, None
        if lease is None or lease.envelope is None:
            return
        try:
            self.backend.nack(lease, 0, count_run=False)
        except Exception:
            logger.warning("job %s: could not hand back the job leased ahead", lease.token, exc_info=True)

    def _reap(self, reaper: Reaper) -> None:
        """Recover expired leases. A failure here never holds up the jobs: it is tried again
        one lease timeout later."""
        try:
            reaper.reap_once()
        except Exception:
            logger.exception("worker: reaping expired leases failed; next try in %gs", self.lease_seconds)
            self.backend.reset_connection()

    def _outage(self, failures: int, deadline: float | None) -> None:
        """The backend is unreachable: keep the worker alive, reconnect and back off."""
        pause = min(2.0 ** (failures - 1), MAX_OUTAGE_PAUSE)
        logger.exception("worker: backend error; retrying in %gs", pause)
        self.backend.close()
        self.backend.reset_connection()
        self._sleep(pause, deadline)

    def _idle(self, seconds: float, deadline: float | None) -> None:
        """After an empty fetch: block on the backend where it can, else sleep."""
        if deadline is not None:
            seconds = min(seconds, max(deadline - time.monotonic(), 0))
        try:
            if self.backend.wait_for_work(self.queues, seconds):
                return
        except Exception:
            logger.warning("worker: waiting for work failed", exc_info=True)
        self._sleep(seconds, deadline)

    def _sleep(self, seconds: float, deadline: float | None) -> None:
        end = time.monotonic() + seconds
        if deadline is not None:
            end = min(end, deadline)
        while not self.stopping and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
