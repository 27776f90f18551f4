"""The backend protocol every engine implements; the worker knows nothing else."""

from __future__ import annotations

import contextlib
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from .. import conf
from ..envelope import Envelope
from ..exceptions import (
    AbortNotSupported,
    AbortRequested,
    BackendUnavailable,
    DependenciesNotSupported,
    InvalidPayload,
    JobsError,
    LeaseLost,
    LimitsNotSupported,
    summary,
)
from ..limits import Limit, describe, limits_for

if TYPE_CHECKING:
    from ..audit import Recorded

# ``Lease.result`` of a run whose value is not kept (``None`` is a value: the job returned it).
NO_RESULT: Any = object()
# Pauses between tries of a settle that hit a transient backend error (then it gives up), each
# cut at random to 50 to 100 %.
# The first retry is at once, on the fresh connection reset_connection() leaves.
SETTLE_RETRY_PAUSES = (0.0, 1.0, 3.0)

_R = TypeVar("_R")


@dataclass(slots=True)
class Lease:
    """A fetched message, held by one worker until it is settled or the lease expires.

    ``envelope`` is ``None`` when the message could not be decoded; ``error`` then says why.
    ``owner_token`` fences the lease: a settle with a stale token raises ``LeaseLost``.
    """

    token: str
    owner_token: str
    expires_at: datetime
    queue: str
    envelope: Envelope | None = None
    error: InvalidPayload | None = None
    raw: Any = None  # backend-specific handle (a broker message, a job id, ...)
    # What a successful run of a ``keep_result`` job returned, set before its ack: a backend
    # may store it with the ack (the database backend does), else ``keep_result`` stores it.
    result: Any = NO_RESULT
    # Claimed ahead of its run, in a batch (``fetch_many``): if this lease is lost before the
    # job starts, the reaper hands the job back without counting a run.
    ahead: bool = False
    # An earlier claim of it ahead was lost (its worker died with it in hand, perhaps running
    # it): its start is recorded with ``begin`` before it runs, so a job that kills its worker
    # is counted from its second crash on.
    must_begin: bool = False

    def seconds_left(self) -> float:
        """Seconds until the lease expires (negative once it has). An aware ``expires_at`` is
        compared with the UTC clock, a naive one (``USE_TZ = False``) with Django's."""
        expires = self.expires_at
        if expires.tzinfo is not None:  # epoch seconds: no datetime made, no timedelta
            return expires.timestamp() - time.time()
        now: datetime = timezone.now()
        return (expires - now).total_seconds()


class Requeue(NamedTuple):
    """A failed run's requeue, written with a batch (:meth:`QueueBackend.settle_many`): its
    lease, when it is due again (``time.time()`` seconds), its error, and whether the run counts."""

    lease: Lease
    due: float
    error: str
    count_run: bool = True


# What became of a :class:`Requeue`: ``True`` requeued, ``False`` its lease was lost (left
# alone), or who asked to abort the job (not requeued, the lease still held: settle it cancelled).
Requeued = bool | str


# What :meth:`QueueBackend.request_abort` did (or an :class:`AbortAsked`).
AbortRequest = Literal["cancelled", "asked", "unknown"]


class AbortAsked(NamedTuple):
    """A running job that was asked to abort before: by whom, and when (``None``: not kept, as
    on Redis). A new request leaves it as it is."""

    by: str
    at: datetime | None = None


class LiveJob(NamedTuple):
    """A message not yet settled for good, as :meth:`QueueBackend.peek` finds it."""

    state: Literal["pending", "in_progress"]  # the ``JobStatus`` values of the same states
    envelope: Envelope


class Hold(NamedTuple):
    """A start the limits refuse for now (:meth:`QueueBackend.acquire`): the job waits ``delay``
    seconds, not counted as a run. ``key`` is the limit that holds it. ``parked``: it waits
    for a running job of ``key`` to end, which wakes it (``delay`` is only a safety net);
    otherwise its start is reserved ``delay`` seconds from now and it then starts without
    asking again."""

    delay: float
    key: str
    parked: bool


class LimitUsage(NamedTuple):
    """How much of a limit is in use now (:meth:`QueueBackend.limit_usage`)."""

    running: int  # jobs holding a concurrency slot
    starts: int  # starts granted within the last period
    reserved: int  # starts reserved for jobs that come back later
    parked: int  # jobs waiting for a concurrency slot


class QueueBackend(ABC):
    """Where jobs wait. One instance per configured name, shared by a process's threads."""

    # nack(delay) and dispatch(delay) hold a job back in the backend itself.
    supports_delay: bool = True
    # Higher priority is fetched first.
    supports_priority: bool = False
    # The broker expires leases itself; reap_expired() has nothing to do.
    native_lease: bool = False
    # abandon() uses the broker's own dead-letter mechanism, which keeps its copy of a failed
    # job even after the job is retried (the admin and jobs_retry say so).
    native_dead_letter: bool = False
    # ack_and_fetch() settles one message and leases the next in a single round trip.
    pipelines_ack_fetch: bool = False
    # fetch_many() claims a batch in one round trip, each message claimed ahead of its run
    # (a lost lease of one that never started is not counted as a run), and ack_many() settles
    # many successes in one round trip.
    supports_prefetch: bool = False
    # settle_many() writes the requeues of failed runs with a batch's acks in one round trip.
    batches_requeues: bool = False
    # A failed run can be requeued for another attempt (the sync backend runs each job once).
    supports_retry: bool = True
    # Messages survive a restart of the backend.
    persistent: bool = True
    # abandon() also records a failed ``Job`` row (the database backend's own row is that record).
    audit_failures: bool = True
    # enqueue() joins the caller's database transaction, so no on_commit deferral is needed.
    transactional: bool = False
    # The database alias of this backend's attempt history (None: the router's choice).
    history_alias: str | None = None
    # A job may wait for parent jobs (``Envelope.parents``) before it becomes ready; the
    # others refuse such a job at dispatch (``DependenciesNotSupported``).
    supports_dependencies: bool = False
    # acquire() enforces rate and concurrency limits across every worker; the others refuse a
    # job under a limit at dispatch (``LimitsNotSupported``).
    supports_limits: bool = False

    # Errors of the backend's client that mean its server could not be reached (not a refused
    # request): a dispatch raises them as ``BackendUnavailable``.
    unavailable_errors: tuple[type[Exception], ...] = (OSError,)

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options
        # The queue and owner token of a one-job claim whose answer was lost (see claim_one).
        self._unanswered: tuple[str, str] | None = None

    def dispatch_error(self, exc: Exception) -> JobsError | None:
        """The error a dispatch raises, chained, for ``exc``, raised by the client:
        ``BackendUnavailable`` for one of :attr:`unavailable_errors`; ``None`` for the others,
        which go up as they are."""
        if isinstance(exc, self.unavailable_errors):
            return BackendUnavailable(f"{self.where()} is unreachable: {summary(exc)}")
        return None

    @classmethod
    def options_problem(cls, options: dict[str, Any]) -> str | None:
        """What is wrong with ``OPTIONS`` (``"needs ..."``), found without connecting, or ``None``:
        ``manage.py check`` reports it before a worker starts."""
        return None

    def where(self) -> str:
        """The backend and its server, for messages (``backend 'default' (redis at host:6379)``);
        never connects."""
        return f"backend {self.name!r} ({type(self).__name__})"

    @abstractmethod
    def enqueue(self, envelope: Envelope) -> str:
        """Store a signed envelope; return its id."""

    def enqueue_many(self, envelopes: list[Envelope]) -> list[str]:
        """Store many envelopes; backends override this with one round trip where they can."""
        return [self.enqueue(envelope) for envelope in envelopes]

    def redispatch(self, envelope: Envelope) -> str:
        """Store again a job that failed or was cancelled, for a fresh start (``jobs_retry``, the
        admin's retry); return its id. As :meth:`enqueue`, except that its parents are not
        consulted again: it waits for none of them, and none settles it. The default is
        ``enqueue``, which is that for a backend without ``supports_dependencies``."""
        return self.enqueue(envelope)

    @abstractmethod
    def fetch(self, queue: str) -> Lease | None:
        """Lease the next ready message of ``queue``, or return ``None``."""

    @abstractmethod
    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        """The run succeeded: settle the message for good (``count_run=False``: it was
        skipped, e.g. its idempotency key had already succeeded)."""

    @abstractmethod
    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        """Requeue the message to be fetched again in ``delay`` seconds.

        ``count_run`` adds the delivery to ``attempts``; it is ``False`` only when the job did
        not run (its idempotency key or single-instance lock was held elsewhere, or a limit
        deferred its start). A backend that can abort a running job never requeues one asked to
        abort: it raises ``AbortRequested``, the lease still held, and the worker settles it with
        :meth:`cancel`.
        """

    def abandon(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        """Settle the message as permanently failed and keep it for audit: the backend's own
        dead letter, then (``audit_failures``) a failed ``Job`` row the admin shows and retries."""
        self.dead_letter(lease, error, count_run=count_run)
        if self.audit_failures and lease.envelope is not None:
            self.record_failure(lease.envelope, error, lease.envelope.attempts + int(count_run), lease.queue)

    @abstractmethod
    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        """The backend's own half of :meth:`abandon` (a failed set, a bury, a dead-letter
        subqueue, a failed row); fenced like every settle."""

    def record_failure(self, envelope: Envelope, error: str, attempts: int, queue: str) -> Recorded | None:
        """Keep a failed ``Job`` row of a job this backend settled for good, delivered on
        ``queue``; the row written, or ``None`` (never raises)."""
        from ..audit import record_failure  # the models load after the app registry

        return record_failure(envelope, error, self.name, attempts, queue)

    def record_missed_failures(self) -> int:
        """The safety net of failed-job records, run by every reaper pass: write the failed
        ``Job`` row of each job this backend failed for good whose row was never written (its
        worker killed between the two writes, or the database unreachable then). Returns how
        many rows it wrote (0: none missing, or a backend that cannot tell)."""
        return 0

    def keep_result(self, lease: Lease, value: Any) -> None:
        """Keep what a successful run of a ``keep_result`` job returned (before its ack: a
        worker killed between the two leaves the job to run again, its row overwritten by its
        next outcome): a completed ``Job`` row holding it, which ``get_result`` reads."""
        from ..audit import record_result  # the models load after the app registry

        assert lease.envelope is not None, "only a decoded message has a result"
        record_result(lease.envelope, value, self.name, lease.envelope.attempts + 1, lease.queue)

    def stored_result(self, job_id: str) -> Any:
        """What the completed job ``job_id`` returned, as ``keep_result`` stored it (a job whose
        ``options["result_of"]`` names it gets it as its first argument); ``None`` when the job
        did not complete or kept no result."""
        from django.db import router

        from ..models import Job, JobStatus  # the models load after the app registry

        db = self.history_alias or router.db_for_read(Job)
        completed = Job.objects.using(db).filter(pk=job_id, status=JobStatus.COMPLETED)
        return completed.values_list("result", flat=True).first()

    def resolve_dependents(self) -> int:
        """The safety net of dependencies, run by every reaper pass: settle or release the
        waiting jobs whose parents all finished by a path that did not resolve their edges (a
        crash between two steps, on backends that cannot do both at once). Idempotent. Returns
        how many waiting jobs it moved on (0: nothing to do, or no dependencies here)."""
        return 0

    def peek(self, job_id: str) -> LiveJob | None:
        """The live state of a message this backend still holds, looked up by id without
        leasing it: ``("pending", envelope)`` while it waits (ready, delayed or due for a
        retry) or ``("in_progress", envelope)`` while it is leased. ``None`` when the message is
        unknown, settled for good, or the backend cannot look a message up by id (the default).
        """
        return None

    @abstractmethod
    def extend(self, lease: Lease, seconds: float) -> str | None:
        """Heartbeat: push the lease's expiry ``seconds`` from now. Returns who asked to abort
        the job (``requested_by`` of :meth:`request_abort`), or ``None``: backends that cannot
        abort a running job always return ``None``."""

    def extend_ahead(self, leases: Sequence[Lease], seconds: float) -> None:
        """Heartbeat, while a job runs: push the expiry of the jobs claimed ahead of it
        ``seconds`` from now. A lease found lost is left alone (the job's start check finds it).
        It must not wait long for one (the running job's next beat comes after it): the
        database backend skips a row another transaction holds locked, until the next beat.
        Default: :meth:`extend` each."""
        for lease in leases:
            with contextlib.suppress(LeaseLost):
                self.extend(lease, seconds)

    def abort_requested(self, lease: Lease) -> str | None:
        """Who asked to abort the job of ``lease`` (``requested_by`` of :meth:`request_abort`),
        or ``None``. The heartbeat asks about once a second between its beats: one cheap read
        that changes nothing (it neither extends nor fences the lease; a lost lease is the
        beat's to find). Backends that cannot abort a running job always return ``None``."""
        return None

    def request_abort(self, job_id: str, requested_by: str) -> AbortRequest | AbortAsked:
        """Abort a job this backend holds and the ``Job`` table does not: a waiting one is taken
        out and recorded ``cancelled`` (``"cancelled"``); a running one is flagged for its
        worker's heartbeat (``"asked"``), unless it was flagged before: then it is left as it
        is, and who asked first is returned (:class:`AbortAsked`); ``"unknown"``: not held
        (settled, or never seen). Raises ``AbortNotSupported`` when the backend cannot look a
        job up by id (the default)."""
        raise AbortNotSupported(f"backend {self.name!r} cannot abort a job by its id")

    def cancel(self, lease: Lease, reason: str, *, count_run: bool = True) -> None:
        """Settle an aborted run as ``cancelled`` for good (never retried), fenced like every
        settle: the default acks the message and keeps a cancelled ``Job`` row with ``reason``."""
        from ..audit import record_cancelled  # the models load after the app registry

        self.ack(lease, count_run=count_run)
        if lease.envelope is not None:
            env = lease.envelope
            record_cancelled(env, reason, self.name, env.attempts + int(count_run), lease.queue)

    @abstractmethod
    def reap_expired(self, queue: str | None = None) -> int:
        """Recover expired leases (``None`` = every queue); return how many."""

    def ping(self) -> None:
        """One cheap round trip that changes nothing; raises while the backend is unreachable.
        A reaper holding back after an outage probes with it. Backends whose broker expires
        leases by itself reap nothing, so they have nothing to probe."""

    @abstractmethod
    def size(self, queue: str) -> int:
        """Messages not yet settled: ready + delayed + leased."""

    def stats(self, queue: str) -> dict[str, int]:
        """Counts for ``jobs_stats``: pending, delayed, in_progress, failed; and ``waiting`` (held
        until their parents finish) on backends with ``supports_dependencies``."""
        counts = {"pending": self.size(queue), "delayed": 0, "in_progress": 0, "failed": 0}
        if self.supports_dependencies:  # (the sync backend: a dependent runs inside its dispatch)
            counts["waiting"] = 0
        return counts

    def oldest_ready_age(self, queue: str) -> float | None:
        """Seconds the oldest job of ``queue`` that is ready to run has waited since it became
        ready; ``None`` when none is ready or the backend cannot tell."""
        return None

    def persistence_warning(self) -> str | None:
        """Why a restart of the server would lose the queued jobs, in one sentence; ``None``
        when it keeps them (or the backend cannot tell)."""
        return None

    def prepare_to_wait(self) -> None:
        """At a worker's start, before it forks: find out how idle workers will wait for work
        (``wait_for_work``), where that depends on the server, and say so in the log. Holds
        no connection afterwards. Nothing to find out by default."""

    def ack_and_fetch(self, lease: Lease, queue: str) -> Lease | None:
        """``ack(lease)``, then lease the next message of ``queue``. A ``LeaseLost`` from the ack
        leases nothing. Backends with ``pipelines_ack_fetch`` do both in one round trip."""
        self.ack(lease)
        return self.fetch(queue)

    def fetch_many(self, queue: str, limit: int) -> list[Lease]:
        """Lease up to ``limit`` ready messages of ``queue``, in the order they are to run.

        Backends with ``supports_prefetch`` claim them in one round trip, each ``ahead`` (see
        :class:`Lease`); the others lease one, as :meth:`fetch` does."""
        lease = self.fetch(queue)
        return [] if lease is None else [lease]

    def can_prefetch(self) -> bool:
        """May a worker claim batches now? (``supports_prefetch``, unless the backend says
        otherwise at the time.)"""
        return self.supports_prefetch

    def ack_many(self, leases: list[Lease], begun: Sequence[Lease] = ()) -> list[Lease]:
        """Ack successful runs, fenced one by one; return the leases found lost (not acked).

        ``begun``: leases claimed ahead whose runs have started meanwhile (none of them in
        ``leases``); their starts are recorded as :meth:`begin` records one, so a loss of one
        counts as a run from now on. Backends with ``supports_prefetch`` write both in one
        round trip. A lease of ``begun`` found lost is left alone."""
        lost = []
        for lease in leases:
            try:
                self.ack(lease)
            except LeaseLost:
                lost.append(lease)
        for lease in begun:
            with contextlib.suppress(LeaseLost):
                self.begin(lease, float(conf.get("LEASE_TIMEOUT")))
        return lost

    def ack_many_and_fetch(self, leases: list[Lease], queue: str, limit: int) -> tuple[list[Lease], list[Lease]]:
        """``ack_many(leases)``, then ``fetch_many(queue, limit)``: the lost leases and the new
        ones. Backends with ``supports_prefetch`` do both in one round trip."""
        return self.ack_many(leases), self.fetch_many(queue, limit)

    def settle_many(
        self, acks: list[Lease], begun: Sequence[Lease] = (), requeues: Sequence[Requeue] = ()
    ) -> tuple[list[Lease], list[Requeued]]:
        """``ack_many(acks, begun)`` and the ``requeues`` of failed runs: the leases found lost
        among ``acks``, and what became of each requeue. Backends with ``batches_requeues`` do
        it in one round trip; here, ``ack_many`` then one :meth:`nack` each."""
        return self.ack_many(acks, begun), [self._requeue(one) for one in requeues]

    def settle_many_and_fetch(
        self, acks: list[Lease], requeues: Sequence[Requeue], queue: str, limit: int
    ) -> tuple[list[Lease], list[Requeued], list[Lease]]:
        """:meth:`settle_many` (no ``begun``), then ``fetch_many(queue, limit)``: in one round
        trip with ``batches_requeues``."""
        done = [self._requeue(one) for one in requeues]
        lost, claimed = self.ack_many_and_fetch(acks, queue, limit)
        return lost, done, claimed

    def _requeue(self, requeue: Requeue) -> Requeued:
        """One requeue of :meth:`settle_many`, by :meth:`nack`."""
        try:
            delay = max(requeue.due - time.time(), 0.0)
            self.nack(requeue.lease, delay, error=requeue.error, count_run=requeue.count_run)
        except LeaseLost:
            return False
        except AbortRequested as asked:
            return asked.requested_by
        return True

    def begin(self, lease: Lease, seconds: float) -> str | None:
        """A lease claimed ahead (``must_begin``) starts its run now: record that, so its loss
        counts as a run from here on, and extend it ``seconds`` from now. Fenced: a lease that
        is no longer ours raises ``LeaseLost``. Returns who asked to abort the job, as
        :meth:`extend` does."""
        return self.extend(lease, seconds)

    def acquire(self, lease: Lease, limits: Sequence[Limit]) -> Hold | None:
        """Take a start under every one of ``limits`` (ordered by key) for the job of ``lease``,
        all or nothing, just before it runs: ``None`` = granted (its concurrency slots are held
        until :meth:`release_limits`); a :class:`Hold` = not now, nothing taken.

        Concurrency: a slot counts only while its job's lease is live, so a crashed worker's
        slot frees when its lease is reaped. A refused job is parked on the full limit.
        Rate: the start is granted when :func:`~django_jobs.limits.rate_slot` says ``now``, else
        that slot is reserved for the job, which starts without asking again when it comes back
        (:func:`~django_jobs.limits.reservation_state`). Fenced: raises ``LeaseLost``."""
        raise LimitsNotSupported(
            f"backend {self.name!r} ({type(self).__name__}) cannot enforce rate or concurrency limits"
        )

    def release_limits(self, lease: Lease) -> None:
        """After the settle of a job that took concurrency slots (or was parked by a full limit,
        after its requeue): free its slots and wake one job parked on each of its limits that
        now has room (ready at once). Idempotent; never raises for a lost lease."""

    def limit_usage(self, limit: Limit) -> LimitUsage | None:
        """What the dashboard shows of ``limit``; ``None`` when the backend cannot tell."""
        return None

    def release(self, lease: Lease) -> None:
        """Hand back a job that did not start (its worker stops, or it waited behind a long
        job): ready again at once, not counted as a run, keeping its place in its queue where the
        backend can (the database backend does; the default queues it again, as ``nack``). A job
        asked to abort is not handed back: ``AbortRequested``, as from :meth:`nack`."""
        self.nack(lease, 0, count_run=False)

    def lose_claims(self, queue: str, owner_token: str, counted: Sequence[str], *, unrun: bool = False) -> None:
        """The worker that claimed jobs of ``queue`` under ``owner_token`` died, as its
        supervisor saw: every lease of that claim expires now, so the next ``reap_expired``
        recovers them at once, and the leases ``counted`` (the job it had in hand, and its
        failed runs whose requeues were not written yet) are no longer claimed ahead, so the
        loss of each counts as a run. ``unrun``: no handler saw any job of that claim (its
        answer was lost, :meth:`claim_one`): each is claimed ahead instead, and goes back
        uncounted. Brokers that expire leases themselves (``native_lease``) have nothing to do."""

    def claim_one(self, queue: str, owner_token: str, claim: Callable[[], _R]) -> _R:
        """``claim()``: a call that claims one job of ``queue`` under ``owner_token``, to run at
        once (not ahead). Were its answer lost (it raised a backend error after the claim may
        have been made), the reaper would count a lost run of that job, which no handler saw:
        the next call first hands such a claim over to the reaper as unrun (:meth:`lose_claims`),
        and it goes back uncounted."""
        if self._unanswered is not None:
            unanswered_queue, unanswered_owner = self._unanswered
            self.lose_claims(unanswered_queue, unanswered_owner, (), unrun=True)
            self._unanswered = None
        try:
            return claim()
        except LeaseLost:  # an ack that came with the claim found its lease lost: nothing claimed
            raise
        except Exception:
            self._unanswered = (queue, owner_token)
            raise

    def purge_failed(self, queue: str, older_than: timedelta | None = None) -> int:
        """Forget failed messages kept by the broker itself (``jobs_purge --status failed``).

        Backends whose failures live only in the ``Job`` table have nothing to do.
        """
        return 0

    def wait_for_work(self, queues: list[str], timeout: float) -> bool:
        """Block until a message may be ready on ``queues`` or ``timeout`` passes.

        Returns ``False`` when the backend cannot block, and the worker sleeps instead.
        """
        return False

    def close(self) -> None:
        """Release connections (called on worker shutdown and after fork)."""

    def reset_connection(self) -> None:
        """After an error in the calling thread (a restarted server, a failover, a killed
        session): drop what this thread holds, so its next call connects afresh. Other threads'
        connections are left alone. The default closes the thread's Django database connections
        (failed-job records and database caches use them) outside a transaction; brokers whose
        clients reconnect by themselves need nothing more."""
        for connection in connections.all(initialized_only=True):
            if not connection.in_atomic_block:
                with contextlib.suppress(Exception):  # a dead connection may fail to close; it is gone
                    connection.close()

    def submit(self, envelopes: list[Envelope]) -> None:
        """Enqueue, deferring to the end of the caller's transaction for non-database backends,
        so a worker never sees a job before the rows it refers to are committed.

        A job with parents is refused at once (``DependenciesNotSupported``) by a backend that
        cannot hold it until they finish; a job under a limit (``LimitsNotSupported``) by one
        that cannot enforce limits."""
        if not self.supports_dependencies and any(envelope.parents for envelope in envelopes):
            raise DependenciesNotSupported(
                f"backend {self.name!r} ({type(self).__name__}) cannot hold a job until its parents finish; "
                f"dependencies, chains and groups need a backend that can ({_dependency_backends()})"
            )
        if not self.supports_limits:
            for envelope in envelopes:
                limits = limits_for(envelope.handler, envelope.queue)
                if limits:
                    raise LimitsNotSupported(
                        f"job {envelope.handler} on queue {envelope.queue!r} is limited ({describe(limits)}), and "
                        f"backend {self.name!r} ({type(self).__name__}) cannot enforce limits: dispatch it to a "
                        "database or Redis backend, or lift the limit"
                    )

        def push() -> None:
            try:
                if len(envelopes) == 1:
                    self.enqueue(envelopes[0])
                else:
                    self.enqueue_many(envelopes)
            except Exception as exc:
                error = self.dispatch_error(exc)
                if error is None:
                    raise
                raise error from exc

        alias = None if self.transactional else atomic_alias()
        if alias is None:
            push()
        else:
            transaction.on_commit(push, using=alias)


class Limiter(Protocol):
    """Where a backend keeps its limits' state (``backends/db_limits.py``, ``redis_limits.py``)."""

    def acquire(self, lease: Lease, limits: Sequence[Limit]) -> Hold | None: ...

    def release(self, lease: Lease) -> None: ...

    def usage(self, limit: Limit) -> LimitUsage: ...


class LimitedBackend(QueueBackend):
    """A backend whose :class:`Limiter` (``self.limits``) enforces limits."""

    supports_limits = True

    @property
    @abstractmethod
    def limits(self) -> Limiter: ...

    def acquire(self, lease: Lease, limits: Sequence[Limit]) -> Hold | None:
        return self.limits.acquire(lease, limits)

    def release_limits(self, lease: Lease) -> None:
        self.limits.release(lease)

    def limit_usage(self, limit: Limit) -> LimitUsage | None:
        return self.limits.usage(limit)


def _dependency_backends() -> str:
    """The configured backends that support dependencies, for an error message."""
    from .. import conf
    from . import get_backend

    names = []
    for name in conf.get("BACKENDS") or {}:
        with contextlib.suppress(Exception):  # an unusable backend is the system checks' business
            if get_backend(name).supports_dependencies:
                names.append(repr(name))
    return f"configured: {', '.join(names)}" if names else "the database engine; none is configured"


def atomic_alias() -> str | None:
    """The database alias whose transaction is open, preferring ``default``."""
    default: str = DEFAULT_DB_ALIAS
    if connections[default].in_atomic_block:
        return default
    alias: str
    for alias in connections:
        if alias != DEFAULT_DB_ALIAS and connections[alias].in_atomic_block:
            return alias
    return None


def retrying_settle(
    backend: QueueBackend,
    action: Callable[[], _R],
    on_error: Callable[[Exception, float], None],
    pauses: Sequence[float] = SETTLE_RETRY_PAUSES,
) -> _R:
    """``action()``, a settle, tried again after each of ``pauses`` (each cut to 50 to 100 %,
    at random) when it raises a backend error (a lock or statement timeout, a brief outage):
    ``on_error(error, pause)`` logs and counts it, then the calling thread's connections are
    reset.
    ``LeaseLost`` and ``AbortRequested`` are answers, not errors: they pass through at once, as
    does the last try's error. A ``LeaseLost`` after a failed try says so (``after_failed_try``):
    that try may have been made, its answer lost."""
    failed = False
    try:
        for pause in pauses:
            try:
                return action()
            except (LeaseLost, AbortRequested):
                raise
            except Exception as exc:  # noqa: BLE001 - any error of the backend's client; the last try raises it
                failed = True
                pause = round(pause * random.uniform(0.5, 1.0), 2)  # not in step with an outage that flaps
                on_error(exc, pause)
                backend.reset_connection()
                time.sleep(pause)
        return action()
    except LeaseLost as lost:
        lost.after_failed_try = failed
        raise


def decode_lease_body(raw: bytes | str, limit: int | None = None) -> tuple[Envelope | None, InvalidPayload | None]:
    """Decode a broker message body for a :class:`Lease` (``limit``: the size cap, see
    :meth:`Envelope.from_bytes`), never raising."""
    try:
        return Envelope.from_bytes(raw, limit), None
    except InvalidPayload as exc:
        return None, exc


class RequeueByCopy(QueueBackend):
    """``nack`` for brokers whose messages cannot change (beanstalkd, Service Bus): prove the
    lease is still ours (``extend``), send a copy with the new ``attempts`` due in ``delay``
    seconds (``put_copy``), then settle the original (``ack``). A crash in between leaves two
    copies: the job may run twice, it is never lost."""

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        env = lease.envelope
        assert env is not None, "only a decoded message can be requeued"
        self.extend(lease, self.lease_seconds())
        self.put_copy(lease.queue, env.next_attempt() if count_run else env, max(delay, 0.0))
        self.ack(lease, count_run=count_run)

    @abstractmethod
    def put_copy(self, queue: str, envelope: Envelope, delay: float) -> None:
        """Send ``envelope`` to ``queue``, due in ``delay`` seconds."""

    @staticmethod
    def lease_seconds() -> float:
        from .. import conf

        return float(conf.get("LEASE_TIMEOUT"))
