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
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from . import conf
from .backends import get_backend
from .backends.base import NO_RESULT, Lease, QueueBackend
from .exceptions import LeaseLost
from .heartbeat import Heartbeat
from .metrics import MetricsCollector, get_collector
from .pipeline import SETTLE_RETRY_PAUSES, DeliveryPipeline, JobContext, Outcome, WorkerResult, format_error
from .reaper import Reaper

__all__ = ["JobContext", "Outcome", "QueueWorker", "WorkerResult", "format_error"]

logger = logging.getLogger("django_jobs.worker")

# Exit status of a worker process ended by a hard timeout (the supervisor restarts it).
EXIT_HARD_TIMEOUT = 75
# The longest pause between tries while the backend is unreachable.
MAX_OUTAGE_PAUSE = 30.0
# Batched acks (PREFETCH > 1): the longest a success waits before its ack is written. A crash
# of the worker within this window runs the job again.
ACK_FLUSH_SECONDS = 0.05


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

    def reserve(self, wanted: int, stopping: bool) -> int:
        """While a batch is claimed: tickets for up to ``wanted`` jobs after the admitted one."""
        if self.once or stopping or self.out_of_time():
            return 0
        if self.max_jobs is not None:
            wanted = min(wanted, self.max_jobs - self.done - 1)
        got = 0
        while got < wanted and (self.budget is None or self.budget.take()):
            got += 1
        return got

    def give_back(self, tickets: int = 1) -> None:
        if self.budget is not None:
            for _ in range(tickets):
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
        prefetch: int | None = None,
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
        # ``run`` claims up to ``prefetch`` jobs at a time where the backend can claim a batch
        # (each claimed ahead of its run) and acks their successes in batches.
        self.prefetch = max(int(conf.get("PREFETCH") if prefetch is None else prefetch), 1)
        self.batching = False  # decided when ``run`` starts
        self._ahead: deque[Lease] = deque()  # leased, not yet processed (each holds a ticket)
        self._acks: list[Lease] = []  # successes whose ack is not written yet
        self._acks_lock = threading.Lock()  # the heartbeat thread flushes them too
        # Told of each lease before its delivery (``True``) and after it (``False``): a pool's
        # supervisor recovers the claims of a worker process that died (``recover_claims``).
        self.in_hand: Callable[[Lease, bool], None] | None = None
        self.pipeline.keep_alive.append(self._extend_ahead)

    # -- one delivery --

    def process_once(self, queue: str | None = None) -> WorkerResult:
        """Fetch at most one message (from ``queue`` or each worker queue in order) and settle it."""
        if self._ahead and queue in (None, self._ahead[0].queue):
            lease: Lease | None = self._ahead.popleft()
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
        if self.in_hand is None:
            return self.pipeline.process(lease)
        self.in_hand(lease, True)
        try:
            return self.pipeline.process(lease)
        finally:
            self.in_hand(lease, False)

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
        self.batching = self.prefetch > 1 and self.backend.can_prefetch()
        if self.batching:
            self.pipeline.ack = self._ack_later
        elif self.backend.pipelines_ack_fetch:
            self.pipeline.ack = lambda lease: self._ack_and_lease_next(lease, limits)
        self.heartbeat.start()
        try:
            while limits.admit(self.stopping, ticket_held=bool(self._ahead)):
                if reaper is not None and time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + self.lease_seconds
                    self._reap(reaper)
                try:
                    result = self._deliver(limits)
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
            self._flush_acks()
            limits.give_back(self._release_ahead())
            self.heartbeat.stop()
            self.batching = False
        return limits.done

    def _deliver(self, limits: RunLimits) -> WorkerResult:
        if not self.batching or self._ahead:
            return self.process_once()
        self._claim_batch(limits)
        return self.process(self._ahead.popleft()) if self._ahead else WorkerResult(Outcome.EMPTY)

    def _ack_and_lease_next(self, lease: Lease, limits: RunLimits) -> None:
        """Ack, and lease the next job in the same round trip when it will certainly run here."""
        if not limits.admit_next(self.stopping):
            return self.backend.ack(lease)
        ahead = None
        try:
            # The first queue, as process_once would try first: priorities between queues hold.
            ahead = self.backend.ack_and_fetch(lease, self.queues[0])
        finally:
            if ahead is None:
                limits.give_back()  # nothing was leased ahead: return its ticket
            else:
                self._ahead.append(ahead)

    # -- batches (PREFETCH > 1) --

    def _claim_batch(self, limits: RunLimits) -> None:
        """Claim the next batch (the admitted job and up to ``prefetch - 1`` more, as the run's
        limits allow), writing the acks waiting to be written in the same round trip. The
        queues are tried in order; the first that has jobs fills the batch."""
        extra = limits.reserve(self.prefetch - 1, self.stopping)
        acks = self._take_acks()
        claimed: list[Lease] = []
        try:
            for queue in self.queues:
                lost, claimed = self.backend.ack_many_and_fetch(acks, queue, extra + 1)
                self._count_lost(lost)
                acks = []
                if claimed:
                    break
        except BaseException:
            self._put_back_acks(acks)
            limits.give_back(extra)
            raise
        limits.give_back(extra - max(len(claimed) - 1, 0))
        self._ahead.extend(claimed)

    def _ack_later(self, lease: Lease) -> None:
        """The pipeline's ack while batching: written with the next claim, or by the heartbeat
        thread once the oldest waiting ack is ``ACK_FLUSH_SECONDS`` old."""
        if lease.result is not NO_RESULT:  # its value is written with its own ack
            return self.backend.ack(lease)
        with self._acks_lock:
            first = not self._acks
            self._acks.append(lease)
        if first:
            self.heartbeat.after(time.monotonic() + ACK_FLUSH_SECONDS, self._flush_acks)

    def _take_acks(self) -> list[Lease]:
        with self._acks_lock:
            acks, self._acks = self._acks, []
        return acks

    def _put_back_acks(self, acks: list[Lease]) -> None:
        if acks:
            with self._acks_lock:
                self._acks[:0] = acks

    def _flush_acks(self) -> None:
        """Write the waiting acks now (from either thread); a backend error is retried a few
        times, then the jobs are left to the reaper (they will run again). Never raises."""
        acks = self._take_acks()
        if not acks:
            return
        try:
            self._count_lost(self.pipeline.retrying(self.backend.ack_many, SETTLE_RETRY_PAUSES, acks))
        except Exception:
            logger.exception("could not write the acks of %d completed job(s); they will run again", len(acks))

    def _count_lost(self, lost: list[Lease]) -> None:
        for lease in lost:
            self.metrics.increment("jobs_lease_lost", queue=lease.queue)
            logger.warning("job %s: lease lost before its ack was written (reaped; it may run again)", lease.token)

    def _extend_ahead(self) -> None:
        """Heartbeat thread, while a job runs: keep the jobs claimed ahead of it leased. One
        found lost is not run (the start check sees it)."""
        for lease in tuple(self._ahead):
            try:
                self.backend.extend(lease, self.lease_seconds)
            except LeaseLost:
                continue

    def _release_ahead(self) -> int:
        """Jobs leased ahead but not started go straight back, not counted as runs. Returns
        how many (their tickets go back to the run's budget)."""
        count = len(self._ahead)
        while self._ahead:
            lease = self._ahead.popleft()
            if lease.envelope is None:
                continue  # undecodable: the reaper settles it (nothing of it can be trusted)
            try:
                self.backend.nack(lease, 0, count_run=False)
            except Exception:
                logger.warning("job %s: could not hand back the job leased ahead", lease.token, exc_info=True)
        return count

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
