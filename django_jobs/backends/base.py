"""The backend protocol every engine implements; the worker knows nothing else."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from .. import signing
from ..envelope import Envelope
from ..exceptions import BadSignature, InvalidPayload, LeaseLost
from ..metrics import get_collector
from ..retry import after_lost_run

logger = logging.getLogger("django_jobs.reaper")


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


class QueueBackend(ABC):
    """Where jobs wait. One instance per configured name, shared by a process's threads."""

    # nack(delay) and dispatch(delay) hold a job back in the backend itself.
    supports_delay: bool = True
    # Higher priority is fetched first.
    supports_priority: bool = False
    # The broker expires leases itself; reap_expired() has nothing to do.
    native_lease: bool = False
    # abandon() uses the broker's own dead-letter mechanism.
    native_dead_letter: bool = False
    # ack_and_fetch() settles one message and leases the next in a single round trip.
    pipelines_ack_fetch: bool = False
    # A failed run can be requeued for another attempt (the sync backend runs each job once).
    supports_retry: bool = True
    # Messages survive a restart of the backend.
    persistent: bool = True
    # enqueue() joins the caller's database transaction, so no on_commit deferral is needed.
    transactional: bool = False

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options

    @abstractmethod
    def enqueue(self, envelope: Envelope) -> str:
        """Store a signed envelope; return its id."""

    def enqueue_many(self, envelopes: list[Envelope]) -> list[str]:
        """Store many envelopes; backends override this with one round trip where they can."""
        return [self.enqueue(envelope) for envelope in envelopes]

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
        not run (its idempotency key or single-instance lock was held elsewhere).
        """

    @abstractmethod
    def abandon(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        """Settle the message as permanently failed and keep it for audit."""

    @abstractmethod
    def extend(self, lease: Lease, seconds: float) -> None:
        """Heartbeat: push the lease's expiry ``seconds`` from now."""

    @abstractmethod
    def reap_expired(self, queue: str | None = None) -> int:
        """Recover expired leases (``None`` = every queue); return how many."""

    @abstractmethod
    def size(self, queue: str) -> int:
        """Messages not yet settled: ready + delayed + leased."""

    def stats(self, queue: str) -> dict[str, int]:
        """Counts for ``jobs_stats``: pending, delayed, in_progress, failed."""
        return {"pending": self.size(queue), "delayed": 0, "in_progress": 0, "failed": 0}

    def ack_and_fetch(self, lease: Lease, queue: str) -> Lease | None:
        """``ack(lease)``, then lease the next message of ``queue``. A ``LeaseLost`` from the ack
        leases nothing. Backends with ``pipelines_ack_fetch`` do both in one round trip."""
        self.ack(lease)
        return self.fetch(queue)

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

    def submit(self, envelopes: list[Envelope]) -> None:
        """Enqueue, deferring to the end of the caller's transaction for non-database backends,
        so a worker never sees a job before the rows it refers to are committed."""
        push: Callable[[], Any] = lambda: self.enqueue_many(envelopes)  # noqa: E731
        alias = None if self.transactional else _atomic_alias()
        if alias is None:
            push()
        else:
            transaction.on_commit(push, using=alias)


def _atomic_alias() -> str | None:
    """The database alias whose transaction is open, preferring ``default``."""
    if connections[DEFAULT_DB_ALIAS].in_atomic_block:
        return DEFAULT_DB_ALIAS
    for alias in connections:
        if alias != DEFAULT_DB_ALIAS and connections[alias].in_atomic_block:
            return alias
    return None


def decode_lease_body(raw: bytes | str) -> tuple[Envelope | None, InvalidPayload | None]:
    """Decode a broker message body for a :class:`Lease`, never raising."""
    try:
        return Envelope.from_bytes(raw), None
    except InvalidPayload as exc:
        return None, exc


# How many lost-run redeliveries one fetch settles (each waits for its backoff or fails) before
# it returns None, so a fetch stays short however many crashed deliveries are queued.
LOST_RUN_BATCH = 10


def settle_lost_runs(backend: QueueBackend, lease: Lease, lost: int, how: str) -> bool:
    """The reaper's rule for brokers that expire leases themselves (``native_lease``).

    The broker's own delivery count shows that ``lost`` earlier deliveries of this message ended
    without a settle (a worker crashed or stalled): each is a failed run, already added to
    ``lease.envelope.attempts``. As ``reap_expired`` does for the other backends, a job whose
    retries are spent is failed (``abandon``, logged as critical and counted as
    ``jobs_failed_permanently``, as the worker does) and one with retries left waits for its
    backoff (``nack``), neither counted again. Returns ``True`` when it settled the lease that
    way, and ``False`` when the lease is to be handed to the worker now (no lost run, a retry
    due at once, or an envelope the worker must reject first: its fields are not trusted
    before its signature is checked).
    """
    env = lease.envelope
    if lost <= 0 or env is None or not _verifies(env, lease.queue):
        return False
    # This delivery follows one whose lease lapsed: one lease recovered, as the reaper counts.
    metrics = get_collector()
    metrics.increment("jobs_reaped", queue=lease.queue)
    delay = after_lost_run(env.attempts - 1, env.max_retries, env.options)
    if delay is not None and delay <= 0:
        return False
    error = f"WorkerLost: {how} (worker crashed or stalled)"
    try:
        if delay is None:
            backend.abandon(lease, error, count_run=False)
            metrics.increment("jobs_failed_permanently", queue=lease.queue)
            logger.critical("job %s (%s) failed permanently after %d run(s): %s",
                            env.id, env.name or env.handler, env.attempts, error)
        else:
            backend.nack(lease, delay, error=error, count_run=False)
            logger.warning("job %s on %s: %s; retried in %gs", env.id, lease.queue, error, delay)
    except LeaseLost:
        pass  # another delivery of it is being handled elsewhere
    return True


def _verifies(envelope: Envelope, queue: str) -> bool:
    try:
        signing.verify_delivery(envelope, queue)
    except (BadSignature, InvalidPayload):
        return False
    return True
