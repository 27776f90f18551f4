"""Lease recovery: jobs whose worker crashed or stalled go back to their queue."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from django.utils import timezone

from . import conf, history, signing
from .backends import get_backend
from .backends.base import Lease, QueueBackend, retrying_settle
from .envelope import Envelope
from .exceptions import BadSignature, InvalidPayload, LeaseLost
from .logfields import log_fields, queues_fields
from .metrics import MetricsCollector, get_collector
from .models import AttemptOutcome
from .retry import after_lost_run
from .signals import emit, job_reaped

logger = logging.getLogger("django_jobs.reaper")


class Reaper:
    """Calls ``reap_expired`` for each queue (every queue when ``queues`` is empty), then the
    backend's sweep of waiting jobs whose parents finished (``resolve_dependents``) and its
    sweep of failed jobs whose row was never written (``record_missed_failures``).

    After the backend was unreachable, leases that expired during the outage may belong to live
    workers whose heartbeats could not get through either: for one lease timeout after the last
    backend error this reaper reaps nothing, so those workers' next beats reach the backend
    first. (A crashed worker's job is recovered one lease timeout later than otherwise.) During
    an outage a process tries again at least every :func:`outage_pause`, so its last error comes
    shortly before the backend returns and the hold-back outlasts the outage's end.
    """

    def __init__(self, backend: QueueBackend | str | None = None, queues: Sequence[str] = ()) -> None:
        self.backend = get_backend(backend) if backend is None or isinstance(backend, str) else backend
        self.queues = list(queues)
        self.metrics: MetricsCollector = get_collector()
        self.grace = float(conf.get("LEASE_TIMEOUT"))
        self._quiet_until = 0.0

    def backend_failed(self) -> None:
        """The backend was just unreachable (for this process): hold reaping for a lease timeout."""
        self._quiet_until = time.monotonic() + self.grace

    def reap_once(self) -> int:
        """Recover every expired lease now; return how many were recovered (0 during the
        grace that follows a backend error)."""
        if time.monotonic() < self._quiet_until:
            return 0
        total = 0
        targets: list[str | None] = list(self.queues) or [None]
        for queue in targets:
            count = self.backend.reap_expired(queue)
            if count:
                self.metrics.increment("jobs_reaped", count, queue=queue or "*")
                logger.warning(
                    "reaped %d expired lease(s) on %s",
                    count,
                    queue or "every queue",
                    extra=log_fields(None, queue, outcome="lost"),
                )
            total += count
        # The safety net of dependencies: waiting jobs whose parents finished by a path that
        # left their edges unresolved (a crash between two steps on a broker).
        resolved = self.backend.resolve_dependents()
        if resolved:
            self.metrics.increment("jobs_dependents_resolved", resolved)
            logger.warning("resolved %d waiting job(s) whose parents had finished", resolved)
        # The safety net of failed-job records: rows a worker killed (or a database down) after
        # a broker's failing script left unwritten.
        recorded = self.backend.record_missed_failures()
        if recorded:
            self.metrics.increment("jobs_failures_recorded_late", recorded)
            logger.warning("recorded %d failed job(s) whose row had not been written", recorded)
        return total

    def run(self, interval: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Reap every ``interval`` seconds until ``should_stop()``. While it holds back after a
        backend error it only probes the backend (:meth:`~QueueBackend.ping`), at least every
        :func:`outage_pause`: each error it meets moves the hold-back's end, so reaping resumes
        two thirds of a lease timeout after the backend returned at the earliest, however long
        the outage and whatever ``interval``."""
        while not should_stop():
            try:
                held_back = self._quiet_until - time.monotonic()
                if held_back > 0:
                    self.backend.ping()
                    pause = min(outage_pause(interval, self.grace), held_back)
                else:
                    self.reap_once()
                    pause = interval
            except Exception:
                logger.exception("reaper: backend error", extra=queues_fields(self.queues))
                self.backend_failed()
                self.backend.close()
                pause = outage_pause(interval, self.grace)
            end = time.monotonic() + pause
            while not should_stop() and time.monotonic() < end:
                time.sleep(max(min(0.1, end - time.monotonic()), 0))


def outage_pause(pause: float, lease_seconds: float) -> float:
    """How long a process that met a backend error waits before it tries again: ``pause``, but
    at most a third of the lease timeout. Its reaper holds off for a lease timeout after its last
    error, so it still holds off for two thirds of one after the backend returns: the live
    workers' beats (due every third) get through first, where a try a whole lease timeout after
    the last error would reap their leases the moment the backend came back."""
    return min(pause, lease_seconds / 3)


def recover_claims(
    backend: QueueBackend | str | None,
    queue: str,
    owner_token: str,
    counted: Sequence[str],
    succeeded: Sequence[str] = (),
) -> int:
    """A worker process died holding the claims of ``owner_token`` on ``queue`` (its
    supervisor saw it die): they are recovered now, not one lease timeout later. The jobs of
    ``succeeded`` (its successes whose acks were not written yet) are acked first, fenced as the
    worker would have, so they do not run again. Each of ``counted`` (the job it had in hand,
    and its failed runs whose requeues were not written yet) counts a lost run, so a job that
    kills its worker, or fails just before its worker dies, ends failed after
    ``max_retries + 1`` runs; the jobs it had claimed ahead and not run go back uncounted.
    Returns how many leases were recovered."""
    target = backend if isinstance(backend, QueueBackend) else get_backend(backend)
    if succeeded:
        _ack_successes(target, queue, owner_token, succeeded)
    target.lose_claims(queue, owner_token, counted)
    return Reaper(target, [queue]).reap_once()


def _ack_successes(backend: QueueBackend, queue: str, owner_token: str, tokens: Sequence[str]) -> None:
    """The acks a dead worker process had not written, retried on a backend error as a
    worker's own settle is (a lock or statement timeout, a brief outage); an error that
    outlasts the retries leaves those jobs to the reaper (they run again)."""
    now = timezone.now()
    leases = [Lease(token=token, owner_token=owner_token, expires_at=now, queue=queue) for token in tokens]
    what = f"the {len(leases)} successful run(s) a dead worker process had not acked"

    def failed(error: Exception, pause: float) -> None:
        logger.warning("could not ack %s; retrying in %gs", what, pause, exc_info=error, extra=queues_fields([queue]))
        get_collector().increment("jobs_backend_errors", queue=queue)

    try:
        lost = retrying_settle(backend, lambda: backend.ack_many(leases), failed)
    except Exception:
        logger.exception("could not ack %s; they will run again", what, extra=queues_fields([queue]))
        return
    logger.info(
        "acked %d successful run(s) a dead worker process had not acked",
        len(leases) - len(lost),
        extra=queues_fields([queue]),
    )


def lost_run(
    backend: QueueBackend,
    job_id: str,
    queue: str,
    attempt: int,
    error: str,
    *,
    retry_in: float | None,
    handler: str | None = None,
) -> None:
    """A lost run was recovered: it waits ``retry_in`` seconds for its next run, or (``None``)
    it had no retries left and failed. It is logged with the job's fields, enters the job's
    attempt history, and ``job_reaped`` is sent."""
    failed = retry_in is None
    extra = log_fields(job_id, queue, handler, attempt, "failed" if failed else "retrying")
    if failed:
        logger.error(
            "job %s lost, failed permanently after %d run(s): %s",
            job_id,
            attempt,
            error,
            extra={**extra, "last_error": error},
        )
    else:
        logger.warning("job %s lost, retrying in %gs: %s", job_id, retry_in, error, extra=extra)
    history.record(
        job_id,
        attempt,
        AttemptOutcome.LOST,
        error=error,
        error_class="django_jobs.exceptions.WorkerLost",
        worker="",
        using=backend.history_alias,
    )
    emit(job_reaped, backend, job_id=job_id, queue=queue, attempt=attempt, failed=failed)


def aborted_lost_run(
    backend: QueueBackend,
    job_id: str,
    queue: str,
    attempt: int,
    requested_by: str,
    error: str,
    *,
    handler: str | None = None,
) -> None:
    """The lost run of a job asked to abort was recovered: instead of a retry, the job was
    settled ``cancelled``. It is logged, enters the job's attempt history as a ``cancelled``
    attempt under who asked, and ``job_reaped`` is sent (``failed``: it will not run again)."""
    extra = log_fields(job_id, queue, handler, attempt, "cancelled")
    first_line = error.partition("\n")[0]
    logger.warning("job %s lost, cancelled (it was asked to abort): %s", job_id, first_line, extra=extra)
    history.record(
        job_id,
        attempt,
        AttemptOutcome.CANCELLED,
        error=error,
        error_class="django_jobs.exceptions.WorkerLost",
        worker=requested_by,
        using=backend.history_alias,
    )
    emit(job_reaped, backend, job_id=job_id, queue=queue, attempt=attempt, failed=True)


# How many lost-run redeliveries one fetch settles (each waits for its backoff or fails) before
# it returns None, so a fetch stays short however many crashed deliveries are queued.
LOST_RUN_BATCH = 10


def settle_lost_runs(backend: QueueBackend, lease: Lease, lost: int, how: str) -> bool:
    """The reaper's rule, applied at fetch by brokers that expire leases themselves (``native_lease``).

    The broker's own delivery count shows that ``lost`` earlier deliveries of this message ended
    without a settle (a worker crashed or stalled): each is a failed run, already added to
    ``lease.envelope.attempts``. As ``reap_expired`` does for the other backends, a job whose
    retries are spent is failed (``abandon``, logged as an error and counted as
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
    error = f"WorkerLost: {how} (worker crashed or stalled)"
    # The delivery just before this one was lost (earlier ones were seen by earlier deliveries).
    lost_run(backend, env.id, lease.queue, env.attempts, error, retry_in=delay, handler=env.handler)
    if delay is not None and delay <= 0:
        return False
    try:
        if delay is None:
            backend.abandon(lease, error, count_run=False)
            metrics.increment("jobs_failed_permanently", queue=lease.queue)
        else:
            backend.nack(lease, delay, error=error, count_run=False)
    except LeaseLost:
        pass  # another delivery of it is being handled elsewhere
    return True


def _verifies(envelope: Envelope, queue: str) -> bool:
    try:
        signing.verify_delivery(envelope, queue)
    except (BadSignature, InvalidPayload):
        return False
    return True
