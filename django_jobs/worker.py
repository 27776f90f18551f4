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
from collections.abc import Callable, Iterable
from typing import Protocol

from . import conf
from .backends import get_backend
from .backends.base import Lease, QueueBackend
from .batches import Batches
from .exceptions import WorkerInterrupted, summary
from .heartbeat import Heartbeat, retry_soon
from .history import Deferred
from .logfields import logged_try, queues_fields
from .metrics import MetricsCollector, get_collector
from .pipeline import (
    INTERRUPTED,
    DeliveryPipeline,
    JobContext,
    Outcome,
    WorkerResult,
    format_error,
)
from .reaper import Reaper, outage_pause
from .timeouts import attempt_running, install_alarm_handler

__all__ = ["JobContext", "Outcome", "QueueWorker", "WorkerResult", "format_error"]

logger = logging.getLogger("django_jobs.worker")

# Exit status of a worker process ended by a hard timeout (the supervisor restarts it).
EXIT_HARD_TIMEOUT = 75
# Exit status of a bounded run (``--once``, ``--max``, ``--max-time``) that never reached its
# backend (EX_UNAVAILABLE).
EXIT_UNREACHABLE = 69
# The longest pause between tries while the backend is unreachable.
MAX_OUTAGE_PAUSE = 30.0


class Budget(Protocol):
    """Tickets shared by the processes of a pool (:class:`~django_jobs.pool.SharedBudget`)."""

    def take(self) -> bool: ...

    def give_back(self) -> None: ...


class Supervisor(Protocol):
    """A pool's supervisor, told what a worker process holds, so that it can recover the
    claims of a process that died (:func:`~django_jobs.reaper.recover_claims`)."""

    def in_hand(self, lease: Lease, running: bool) -> None:
        """Before (``True``) and after (``False``) each delivery of ``lease``."""

    def unwritten(self, lease: Lease) -> bool:
        """A failed run of ``lease`` whose requeue waits for the batch's next write: counted as
        a lost run if the process dies first. ``False`` when it cannot be kept (its requeue is
        then written at once)."""

    def succeeded(self, lease: Lease) -> bool:
        """A success of ``lease`` whose ack waits for the batch's next write: acked by the
        supervisor if the process dies first. ``False`` when it cannot be kept (its ack is then
        written at once)."""

    def written(self, leases: Iterable[Lease]) -> None:
        """The acks or requeues of ``leases`` were written (or given up): no longer kept here."""


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
        tracebacks: bool = False,
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
        # ``run`` claims jobs in batches of up to ``prefetch`` where the backend can, each
        # claimed ahead of its run, and acks their successes together.
        self.prefetch = max(int(conf.get("PREFETCH") if prefetch is None else prefetch), 1)
        self.batching = False  # decided when ``run`` starts
        self.batches = Batches(
            self.backend,
            self.heartbeat,
            self.metrics,
            maximum=self.prefetch,
            lease_seconds=self.lease_seconds,
            settle=lambda action, leases, pauses: self.pipeline.retrying(action, pauses, leases),
            cancel=self.pipeline.cancel_unstarted,
            requeued=self.pipeline.requeued,
            refused=self.pipeline.requeue_refused,
            history=Deferred(self.backend.history_alias),
        )
        self.pipeline.keep_alive.append(self.batches.extend)
        # A pool's supervisor, told of each delivery and of the failed runs whose requeues wait
        # for the batch: it recovers the claims of a worker process that died.
        self.supervisor: Supervisor | None = None
        # Read by the presence thread (:mod:`~django_jobs.presence`), written here only: the
        # job in hand (its id, ``time.time()`` when it started, and its name or else its handler)
        # and the deliveries so far per (queue, outcome), which only ever grow.
        self.current: tuple[str, float, str] | None = None
        self.tally: dict[tuple[str, Outcome], int] = {}
        # An unreachable backend is logged in one line per try; ``tracebacks`` adds each one's.
        self.tracebacks = tracebacks
        # After ``run``: the error that kept it from ever reaching the backend, if it never did.
        self.unreachable: Exception | None = None

    # -- one delivery --

    def process_once(self, queue: str | None = None) -> WorkerResult:
        """Fetch at most one message (from ``queue`` or each worker queue in order) and settle it."""
        lease = self.batches.take(queue) or self._fetch(queue)
        return WorkerResult(Outcome.EMPTY) if lease is None else self.process(lease)

    def _fetch(self, queue: str | None) -> Lease | None:
        for name in (queue,) if queue else self.queues:
            lease = self.backend.fetch(name)
            if lease is not None:
                return lease
        return None

    def process(self, lease: Lease) -> WorkerResult:
        """Verify, run and settle one fetched lease. Never raises for a job's own failure."""
        envelope, supervisor = lease.envelope, self.supervisor
        if envelope is None:
            self.current = (lease.token, time.time(), "")
        else:
            self.current = (envelope.id, time.time(), envelope.name or envelope.handler)
        if supervisor is not None:
            supervisor.in_hand(lease, True)
        try:
            result = self.pipeline.process(lease)
        finally:
            self.current = None
            self.batches.ended(lease)
            if supervisor is not None:
                supervisor.in_hand(lease, False)
        key = (lease.queue, result.status)
        tally = self.tally
        tally[key] = tally.get(key, 0) + 1
        return result

    def _after_hard_timeout(self) -> None:
        if self.exit_on_hard_timeout:
            logging.shutdown()
            os._exit(EXIT_HARD_TIMEOUT)

    # -- the loop --

    def stop(self) -> None:
        """Ask ``run`` to return after the current job (safe to call from a signal handler)."""
        self.stopping = True

    def interrupt(self) -> None:
        """Stop at once (a second ``SIGINT``): call it from the signal handler, in the main
        thread. The run in progress ends with :class:`WorkerInterrupted`, raised into it from
        here, and goes back to its queue without counting a run; a run about to begin does not
        begin. ``run`` then returns. A job stuck where no signal reaches it (a C call) runs on:
        a supervisor ends its process (:class:`~django_jobs.pool.WorkerPool`)."""
        self.stopping = True
        if self.pipeline.interrupted:
            return
        self.pipeline.interrupted = True
        if attempt_running():
            raise WorkerInterrupted(INTERRUPTED)

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
        reap_at_start: bool = True,
    ) -> int:
        """Process jobs until stopped, out of jobs (``once``), ``max_jobs`` or ``max_time``.

        ``budget`` is shared by the processes of a pool (``take()``/``give_back()``).
        ``reap`` reaps the worker's queues every ``LEASE_TIMEOUT``, first at the start unless
        ``reap_at_start`` is false (a pool's supervisor reaps them while its processes start).
        Returns the number of deliveries processed.
        """
        sleep = conf.get("POLL_INTERVAL") if sleep is None else sleep
        limits = RunLimits(max_jobs, max_time, once, budget)
        reaper = Reaper(self.backend, self.queues) if reap else None
        if reaper is not None:
            reaper.metrics = self.metrics
            # A settle or a beat that cannot reach the backend holds this process's reaping off.
            self.pipeline.on_backend_error = self.heartbeat.on_backend_error = reaper.backend_failed
        next_reap = time.monotonic() + (0 if reap_at_start else self.lease_seconds) if reaper else math.inf
        outages, reached, self.unreachable = 0, False, None
        self.batching = self.prefetch > 1 and self.backend.can_prefetch()
        self.batches.tickets, self.batches.supervisor = limits, self.supervisor
        if self.batching:
            self.pipeline.ack = self.batches.ack_later
            self.pipeline.on_start = self.batches.started
            self.pipeline.record = self.batches.history.write
            if self.backend.batches_requeues:
                self.pipeline.requeue_later = self.batches.requeue_later
        elif self.backend.pipelines_ack_fetch:
            self.pipeline.ack = lambda lease: self._ack_and_lease_next(lease, limits)
        self.pipeline.keep_unsettled = True
        self.heartbeat.start()
        restore_alarm = install_alarm_handler()  # an abort the heartbeat passes on can interrupt any job
        try:
            while limits.admit(self.stopping, ticket_held=bool(self.batches)):
                try:
                    if self.pipeline.unsettled:  # first what an outage kept: its leases are still ours
                        self.pipeline.settle_unsettled()
                    if reaper is not None and time.monotonic() >= next_reap:
                        next_reap = time.monotonic() + self.lease_seconds
                        self._reap(reaper)
                    result = self._deliver()
                except Exception as exc:  # noqa: BLE001 - logged by _outage: the backend is unreachable
                    limits.give_back()
                    if reaper is not None:
                        reaper.backend_failed()
                    outages += 1
                    if not reached:
                        self.unreachable = exc
                    if once:  # one fetch: it failed
                        self._log_outage(exc, None)
                        break
                    self._outage(exc, outages, limits.deadline)
                    continue
                outages, reached, self.unreachable = 0, True, None
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
            restore_alarm()
            self.pipeline.keep_unsettled = False
            self._settle_unsettled_at_exit()
            self.pipeline.ack = self.backend.ack
            self.pipeline.on_start = None
            self.pipeline.requeue_later = None
            self.pipeline.on_backend_error = self.heartbeat.on_backend_error = None
            self.batches.finish()  # the rows it keeps, then its acks and requeues
            self.pipeline.record = self.pipeline.record_now
            self.batches.tickets = self.batches.supervisor = None
            self.heartbeat.stop()
            self.batching = False
        return limits.done

    def _settle_unsettled_at_exit(self) -> None:
        """One last try for what an outage kept from the backend; what still fails is left to
        the reaper (those jobs run again)."""
        try:
            self.pipeline.settle_unsettled()
        except Exception as exc:  # noqa: BLE001 - logged; the reaper recovers those leases
            logger.error(
                "worker: %d job(s) could not be settled before the worker stopped (%s); the reaper "
                "will recover them and they will run again",
                len(self.pipeline.unsettled) + 1,
                summary(exc),
                extra=queues_fields(self.queues),
            )
            self.pipeline.unsettled.clear()

    def _deliver(self) -> WorkerResult:
        if not self.batching:
            return self.process_once()
        if not self.batches:
            self.batches.claim(self.queues, self.stopping)
        lease = self.batches.take()
        if lease is None:
            return WorkerResult(Outcome.EMPTY)
        start = time.monotonic()
        result = self.process(lease)
        self.batches.timed(time.monotonic() - start)
        return result

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
                self.batches.hold(ahead)

    def _reap(self, reaper: Reaper) -> None:
        """Recover expired leases. A failure here never holds up the jobs: it is tried again
        one lease timeout later."""
        try:
            reaper.reap_once()
        except Exception as exc:
            logger.error(
                "worker: reaping expired leases failed on %s: %s; next try in %gs",
                self.backend.where(),
                summary(exc),
                self.lease_seconds,
                exc_info=exc if self.tracebacks else None,
                extra=queues_fields(self.queues),
            )
            self.backend.reset_connection()

    def _outage(self, exc: Exception, failures: int, deadline: float | None) -> None:
        """The backend is unreachable: keep the worker alive, reconnect and back off; while
        settles wait (kept by the outage, or a batch's acks and requeues), whose leases lapse
        unless one gets through, try again soon (:func:`~django_jobs.heartbeat.retry_soon`),
        logging the 1st, 2nd, 4th, 8th ... try."""
        if self.pipeline.unsettled or self.batches.unwritten():
            pause = retry_soon(self.lease_seconds)
            if logged_try(failures):
                self._log_outage(exc, pause)
        else:
            pause = outage_pause(min(2.0 ** (failures - 1), MAX_OUTAGE_PAUSE), self.lease_seconds)
            self._log_outage(exc, pause)
        self.backend.close()
        self.backend.reset_connection()
        self._sleep(pause, deadline)

    def _log_outage(self, exc: Exception, pause: float | None) -> None:
        """One line naming the backend, its server and the error (and the traceback, with
        ``tracebacks``)."""
        then = "giving up" if pause is None else f"retrying in {pause:.3g}s"
        logger.error(
            "worker: %s failed: %s; %s",
            self.backend.where(),
            summary(exc),
            then,
            exc_info=exc if self.tracebacks else None,
            extra=queues_fields(self.queues),
        )

    def _idle(self, seconds: float, deadline: float | None) -> None:
        """After an empty fetch: block on the backend where it can, else sleep."""
        if deadline is not None:
            seconds = min(seconds, max(deadline - time.monotonic(), 0))
        try:
            if self.backend.wait_for_work(self.queues, seconds):
                return
        except Exception as exc:
            logger.warning(
                "worker: waiting for work on %s failed: %s",
                self.backend.where(),
                summary(exc),
                exc_info=exc if self.tracebacks else None,
                extra=queues_fields(self.queues),
            )
        self._sleep(seconds, deadline)

    def _sleep(self, seconds: float, deadline: float | None) -> None:
        end = time.monotonic() + seconds
        if deadline is not None:
            end = min(end, deadline)
        while not self.stopping and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
