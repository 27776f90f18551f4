"""The jobs a worker holds before it runs them, and the acks it has not written yet.

Where the backend can (``supports_prefetch``: the database and Redis backends), a worker claims
several jobs in one round trip, each *claimed ahead* of its run, and writes the acks of its
successes together with its next claim. How many it claims follows the jobs: about
``BATCH_SECONDS`` of work by the recent jobs' durations, at most ``PREFETCH``, so short jobs are
claimed many at a time and long ones one at a time (the next ones stay free for other workers).

The heartbeat thread watches each batch: every ``BATCH_SECONDS`` it writes the waiting acks and
requeues, and the start of a job claimed ahead within half of that after its handler is called
(so that from then on a loss of its lease counts as a run), and
once a batch has run ``HAND_BACK_AFTER`` seconds (a long job in it) it hands the jobs still
waiting in it back, uncounted, so that other workers run them.

Every write of a batch writes the attempt rows it keeps first, then the requeues: a retry is
never claimable before the row of the run that failed exists.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .backends.base import NO_RESULT, SETTLE_RETRY_PAUSES, Lease, QueueBackend, Requeue, Requeued
from .exceptions import MAYBE_SETTLED, AbortRequested, LeaseLost, summary
from .heartbeat import Heartbeat, retry_soon
from .history import Deferred
from .logfields import debug_traceback, lease_fields, logged_try
from .metrics import MetricsCollector

if TYPE_CHECKING:
    from .pipeline import Verdict
    from .worker import Supervisor

# What settling a batch writes: the leases found lost among the acks, and what became of each
# requeue.
Settled = tuple[list[Lease], list[Requeued]]

logger = logging.getLogger("django_jobs.worker")

# A batch holds about this much work, and a success waits about this long for its ack to be
# written, a start for its record (a crash of the worker in that window runs the job again; one
# frozen in that window after a start runs it again uncounted).
BATCH_SECONDS = 0.05
# A batch still running after this long holds a long job: the jobs waiting behind it go back.
HAND_BACK_AFTER = 1.0
# Weight of the newest job in the running average of a job's duration.
SMOOTHING = 0.3


class Tickets(Protocol):
    """The run's limits (``--max`` across a pool's processes): one ticket per job held."""

    def reserve(self, wanted: int, stopping: bool) -> int: ...

    def give_back(self, tickets: int = 1) -> None: ...


class Batches:
    """One worker's jobs claimed ahead (each holds a ticket) and its successes not acked yet.

    The main thread claims and takes jobs; the heartbeat thread writes acks, keeps the claims
    leased and hands them back: both sides go through a lock.
    """

    def __init__(
        self,
        backend: QueueBackend,
        heartbeat: Heartbeat,
        metrics: MetricsCollector,
        *,
        maximum: int,
        lease_seconds: float,
        settle: Callable[[Callable[[list[Lease]], Settled], list[Lease], tuple[float, ...]], Settled],
        cancel: Callable[[Lease, str], object],
        requeued: Callable[[list[tuple[Lease, Verdict]]], None],
        refused: Callable[[Lease, Verdict, str], object],
        history: Deferred,
    ) -> None:
        self.backend, self.heartbeat, self.metrics = backend, heartbeat, metrics
        self.maximum, self.lease_seconds = maximum, lease_seconds
        self.settle = settle  # runs a backend call, retrying transient errors after each pause
        self.cancel = cancel  # settles a job held here that was asked to abort (who asked)
        self.requeued = requeued  # failed runs whose requeues were written: count them
        self.refused = refused  # a failed run's requeue refused, the job asked to abort: cancel it (never raises)
        self.tickets: Tickets | None = None  # the run's, while it runs
        self.supervisor: Supervisor | None = None  # a pool's, while it runs: told of waiting acks and requeues
        self.history = history  # attempt rows written before the batch's next write
        self._ahead: deque[Lease] = deque()
        self._acks: list[Lease] = []
        self._requeues: list[tuple[Requeue, Verdict]] = []  # failed runs, written with the acks
        # Started, claimed ahead, their starts not written yet (by ``id``: ended drops one in O(1)).
        self._begun: dict[int, Lease] = {}
        self._watch_due: float | None = None  # when the ``_watch`` scheduled on the heartbeat runs
        self._failed_writes = 0  # in a row: while the run goes on, the 1st, 2nd, 4th ... is logged
        # Acks and requeues (by ``id`` of their lease) of a write that failed: it may have been
        # made, its answer lost, so a later write that finds the lease gone says so.
        self._tried: set[int] = set()
        self._lock = threading.Lock()
        # One write of the batch at a time: the next claim waits for the heartbeat's write of the
        # requeues it took, so the supervisor never hears of a new claim while runs of the last
        # one are unwritten (it recovers the claim it last heard of).
        self._writing = threading.Lock()
        self._claimed_at = 0.0
        self._job_seconds = BATCH_SECONDS / 10  # so the first batch holds 10 jobs

    def __bool__(self) -> bool:
        return bool(self._ahead)

    def unwritten(self) -> bool:
        """Do acks or requeues wait for a write (their leases lapse unless one gets through)?"""
        return bool(self._acks or self._requeues)

    # -- the main thread --

    def take(self, queue: str | None = None) -> Lease | None:
        """The next job held ahead (of ``queue``, if given), or ``None``."""
        with self._lock:
            if self._ahead and queue in (None, self._ahead[0].queue):
                return self._ahead.popleft()
        return None

    def hold(self, lease: Lease) -> None:
        """Keep a job leased ahead by other means (an ack that also leased the next job)."""
        with self._lock:
            self._ahead.append(lease)

    def claim(self, queues: list[str], stopping: bool) -> None:
        """Claim the next batch, the admitted job and as many more as its size and the run's
        tickets allow, writing the waiting acks in the same round trip. The queues are tried in
        order; the first that has jobs fills the batch."""
        assert self.tickets is not None, "claims are made by a run"
        size = max(1, min(self.maximum, int(BATCH_SECONDS / max(self._job_seconds, 1e-6))))
        extra = self.tickets.reserve(size - 1, stopping)
        with self._writing:
            try:
                claimed = self._settle_and_claim(queues, extra + 1)
            except BaseException:
                self.tickets.give_back(extra)
                raise
        self.tickets.give_back(extra - max(len(claimed) - 1, 0))
        with self._lock:
            self._ahead.extend(claimed)
            # What waited was written with the claim: the watch due for it is not, so that
            # the heartbeat thread writes only what waits longer (none while batches are short).
            self._watch_due = None
            if claimed:
                self._claimed_at = time.monotonic()
                self._watch_later()

    def _settle_and_claim(self, queues: list[str], limit: int) -> list[Lease]:
        """Under ``_writing``: write the waiting acks and requeues, and claim up to ``limit``
        jobs of the first of ``queues`` that has any."""
        with self._lock:
            acks, self._acks = self._acks, []
            requeues, self._requeues = self._requeues, []
        self._write_history()  # the requeues' rows, before the retries are claimable
        claimed: list[Lease] = []
        try:
            for queue in queues:
                lost, done, claimed = self.backend.settle_many_and_fetch(
                    acks, [requeue for requeue, _ in requeues], queue, limit
                )
                acked, written, acks, requeues = acks, requeues, [], []
                self._count_lost(lost)
                self._written(acked, written, done)
                if claimed:
                    break
        except BaseException:
            self._put_back(acks, requeues)
            raise
        return claimed

    def started(self, lease: Lease) -> None:
        """The pipeline calls the handler of ``lease`` now: if it was claimed ahead, its start
        is written with the next acks, sent at most ``BATCH_SECONDS / 2`` from now (so that it
        is written within ``BATCH_SECONDS`` of the start)."""
        if lease.ahead and not lease.must_begin:  # must_begin: begun before the start already
            with self._lock:
                self._begun[id(lease)] = lease
                self._watch_later(BATCH_SECONDS / 2)

    def ended(self, lease: Lease) -> None:
        """The delivery of ``lease`` is over: its settle (or ack, waiting here) ends the claim."""
        if self._begun:
            with self._lock:
                self._begun.pop(id(lease), None)

    def timed(self, seconds: float) -> None:
        """One job took ``seconds``: the size of the next batches follows."""
        self._job_seconds += SMOOTHING * (seconds - self._job_seconds)

    def ack_later(self, lease: Lease) -> None:
        """The pipeline's ack: written with the next claim or by the heartbeat thread. The
        supervisor is told of it meanwhile, so that it acks the job if this process dies before
        that write. At once for a lease past half its time (its worker was frozen, perhaps past
        it), so that a lost one is said to be lost, not completed, and for one the supervisor
        could not be told of."""
        if lease.result is not NO_RESULT:  # its value is written with its own ack
            return self.backend.ack(lease)
        if lease.seconds_left() < self.lease_seconds / 2:
            return self.backend.ack(lease)
        with self._lock:  # told before a write can take the ack
            later = self.supervisor is None or self.supervisor.succeeded(lease)
            if later:
                self._acks.append(lease)
        if not later:
            self.backend.ack(lease)

    def requeue_later(self, lease: Lease, verdict: Verdict, row: dict[str, Any]) -> bool:
        """The pipeline's requeue of a failed run, and its attempt ``row``: written with the
        next claim or by the heartbeat thread, the row first (one statement for all the rows a
        write keeps), then counted (``requeued``). The supervisor is told of the run meanwhile,
        so that a death of this process before the write counts it. ``False``, to be written now
        (the row first), for a lease past half its time (as :meth:`ack_later` decides), and for
        a run whose start is not written yet that no supervisor was told of: if this process
        died before the batch's next write, it would be handed back uncounted."""
        if lease.seconds_left() < self.lease_seconds / 2:
            return False
        requeue = Requeue(lease, time.time() + max(verdict.delay, 0.0), verdict.error or "", verdict.count_run)
        with self._lock:  # the row is kept before a write can take the requeue
            told = self.supervisor is not None and self.supervisor.unwritten(lease)
            if not told and id(lease) in self._begun:
                return False
            self.history.later(row)
            self._requeues.append((requeue, verdict))
            self._watch_later()
        return True

    def finish(self) -> None:
        """The run ends: write the waiting acks and hand back every job held ahead."""
        self.heartbeat.cancel()
        with self._lock:
            self._watch_due = None
        self.flush()
        self.hand_back()

    # -- either thread --

    def flush(self, keep: bool = False) -> bool:
        """Write the kept attempt rows, then the waiting acks, starts and requeues. Then, with
        ``keep`` (while the run goes on), a failed write is tried again once at once, and the
        acks and requeues wait for the next write, soon: they are still ours while the reapers
        hold back after the outage. Without it (the run's end), a backend error is retried a few
        times, then they are left to the reaper and will run again. ``False`` when the write
        failed. Never raises."""
        with self._writing:
            return self._flush(keep)

    def _flush(self, keep: bool) -> bool:
        with self._lock:
            acks, self._acks = self._acks, []
            requeues, self._requeues = self._requeues, []
            # An ack or a requeue ends the claim too: once per row.
            settled = {id(lease) for lease in acks} | {id(requeue.lease) for requeue, _ in requeues}
            begun = [lease for key, lease in self._begun.items() if key not in settled]
            self._begun = {}
        self._write_history()  # the requeues' rows, before the retries are claimable
        if not acks and not begun and not requeues:
            return True

        def write(leases: list[Lease]) -> Settled:
            try:
                return self.backend.settle_many(leases, begun, [requeue for requeue, _ in requeues])
            except Exception:  # the try again, if any, may find what this one wrote
                self._mark_tried(acks, requeues)
                raise

        try:
            lost, done = self.settle(write, acks, (0.0,) if keep else SETTLE_RETRY_PAUSES)
        except Exception as exc:
            self._failed_writes += 1
            logger.log(
                logging.ERROR if not keep or logged_try(self._failed_writes) else logging.DEBUG,
                "could not write the acks of %d completed job(s) and the requeues of %d failed one(s) (%s); %s",
                len(acks),
                len(requeues),
                summary(exc),
                "trying again" if keep else "they will run again",
                exc_info=debug_traceback(logger, exc),
            )
            if keep:
                self._put_back(acks, requeues)
            else:
                self._told_written(acks, requeues)
            return False
        self._failed_writes = 0
        self._count_lost(lost)
        self._written(acks, requeues, done)
        return True

    def hand_back(self) -> None:
        """Jobs held ahead go straight back, not counted as runs, with their tickets (one asked
        to abort meanwhile is cancelled instead)."""
        with self._lock:
            leases = list(self._ahead)
            self._ahead.clear()
        for lease in leases:
            if lease.envelope is None:
                continue  # undecodable: the reaper settles it (nothing of it can be trusted)
            try:
                try:
                    self.backend.release(lease)
                except AbortRequested as asked:
                    self.cancel(lease, asked.requested_by)
            except LeaseLost:
                logger.info(
                    "job %s: its claim ahead was lost (reaped) before it started; not run here",
                    lease.token,
                    extra=lease_fields(lease, outcome="lost"),
                )
            except Exception:
                logger.warning(
                    "job %s: could not hand back the job leased ahead",
                    lease.token,
                    exc_info=True,
                    extra=lease_fields(lease),
                )
        if leases and self.tickets is not None:
            self.tickets.give_back(len(leases))

    def extend(self) -> None:
        """Heartbeat, while a job runs: keep the jobs held ahead of it leased (one found lost
        is not run: the pipeline's start check sees it)."""
        with self._lock:
            leases = tuple(self._ahead)
        if leases:
            self.backend.extend_ahead(leases, self.lease_seconds)

    # -- the heartbeat thread --

    def _watch(self) -> None:
        """Every ``BATCH_SECONDS`` while a batch lasts: write its acks; after
        ``HAND_BACK_AFTER``, hand back the jobs still waiting in it. After a failed write, the
        next try comes soon, at a random moment (:func:`~django_jobs.heartbeat.retry_soon`)."""
        written = self.flush(keep=True)
        if self._ahead and time.monotonic() - self._claimed_at >= HAND_BACK_AFTER:
            self.hand_back()
        with self._lock:
            self._watch_due = None
            if self._ahead or self._acks or self._begun or self._requeues or self.history:
                self._watch_later(BATCH_SECONDS if written else retry_soon(self.lease_seconds))

    def _watch_later(self, delay: float = BATCH_SECONDS) -> None:
        """Under the lock: ``_watch`` in ``delay`` seconds, unless one is due sooner."""
        due = time.monotonic() + delay
        if self._watch_due is not None and self._watch_due <= due:
            return
        self._watch_due = due
        self.heartbeat.after(due, self._watch)

    # -- helpers --

    def _write_history(self) -> None:
        """Also with no row kept: a write of rows under way in another thread (taken before this
        batch's requeues) finishes first."""
        self.history.write()

    def _put_back(self, acks: list[Lease], requeues: list[tuple[Requeue, Verdict]]) -> None:
        """After a failed write: back for the next one (marked as tried)."""
        if acks or requeues:
            self._mark_tried(acks, requeues)
            with self._lock:
                self._acks[:0] = acks
                self._requeues[:0] = requeues

    def _mark_tried(self, acks: list[Lease], requeues: list[tuple[Requeue, Verdict]]) -> None:
        self._tried.update(id(lease) for lease in acks)
        self._tried.update(id(requeue.lease) for requeue, _ in requeues)

    def _written(self, acks: list[Lease], requeues: list[tuple[Requeue, Verdict]], done: list[Requeued]) -> None:
        """A batch wrote ``acks`` and ``requeues``: what became of each requeue (counted and
        recorded, lost, or refused)."""
        requeued = []
        for (requeue, verdict), outcome in zip(requeues, done, strict=True):
            lease = requeue.lease
            if outcome is True:
                requeued.append((lease, verdict))
            elif outcome is False:
                self._count_lost([lease], "requeue")
            else:
                self.refused(lease, verdict, outcome)
        if requeued:
            self.requeued(requeued)
        self._told_written(acks, requeues)

    def _told_written(self, acks: list[Lease], requeues: list[tuple[Requeue, Verdict]]) -> None:
        if self._tried:
            self._tried.difference_update(id(lease) for lease in acks)
            self._tried.difference_update(id(requeue.lease) for requeue, _ in requeues)
        if (acks or requeues) and self.supervisor is not None:
            self.supervisor.written([*acks, *(requeue.lease for requeue, _ in requeues)])

    def _count_lost(self, lost: list[Lease], what: str = "ack") -> None:
        for lease in lost:
            self.metrics.increment("jobs_lease_lost", queue=lease.queue)
            logger.warning(
                "job %s: lease lost before its %s was written (reaped; it may run again)%s",
                lease.token,
                what,
                MAYBE_SETTLED if id(lease) in self._tried else "",
                extra=lease_fields(lease, outcome="lost"),
            )
