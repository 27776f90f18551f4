"""The delivery pipeline: one fetched lease -> verify -> guards -> run -> decide -> settle.

Each step either hands the delivery on or ends it with a :class:`Verdict`; :meth:`settle` is
the one place a verdict reaches the backend, and its :class:`WorkerResult` is built once there.
The pipeline knows only the backend protocol. It runs in the worker's main thread; the
:class:`~django_jobs.heartbeat.Heartbeat` keeps the lease alive from the moment the delivery is
trusted until it is settled, so the guards run under the heartbeat too.

What no single delivery may do, whatever it contains:

- run before its signature and queue are verified (it is rejected, never run);
- start on a lease this worker no longer holds (it ends ``lease-lost``, not run);
- settle from a process that did not claim it (a job's forked child that unwinds out of the
  job exits at once);
- leave its lease to the reaper because of an error in the worker's own code or in a guard's
  cache (it is settled at once as a failed run, with that error recorded).
"""

from __future__ import annotations

import inspect
import linecache
import logging
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, ParamSpec, TypeVar

from django.db import connections
from django.utils import timezone

from . import conf, coroutines, history, registry, signing
from .backends.base import SETTLE_RETRY_PAUSES, Hold, Lease, QueueBackend, retrying_settle
from .current import running_job
from .envelope import Envelope, check_storable, dumps_payload, storable
from .exceptions import (
    MAYBE_SETTLED,
    AbortRequested,
    BackendUnavailable,
    BadSignature,
    HandlerNotAllowed,
    InvalidPayload,
    JobAborted,
    JobsError,
    JobTimeout,
    LeaseLost,
    LimitsNotSupported,
    WorkerInterrupted,
    summary,
)
from .heartbeat import Heartbeat
from .idempotency import Claim, IdempotencyGuard
from .ids import seconds_of
from .limits import Limit, describe, limits_for
from .locks import CacheLock
from .logfields import debug_traceback, lease_fields, log_fields
from .metrics import MetricsCollector, get_collector
from .models import AttemptOutcome
from .retry import has_retries_left, may_run, policy_for
from .signals import emit, job_dead_lettered, job_failed, job_rejected, job_started, job_succeeded
from .timeouts import HARD_TIMEOUT_GRACE, TimeLimit

logger = logging.getLogger("django_jobs.worker")

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Failures that no retry can fix.
PERMANENT_ERRORS = (BadSignature, HandlerNotAllowed, InvalidPayload)
MAX_ERROR_CHARS = 20_000


class Outcome(StrEnum):
    """How one delivery ended (``WorkerResult.status``)."""

    EMPTY = "empty"  # nothing was fetched
    ACKED = "acked"  # the run succeeded
    REQUEUED = "requeued"  # the run failed and waits for a retry, or it did not run and waits
    DEAD_LETTERED = "dead-lettered"  # failed for good, kept for audit
    REJECTED = "rejected"  # undecodable, badly signed or an unknown handler: never run
    SKIPPED_IDEMPOTENT = "skipped-idempotent"  # its idempotency key already succeeded
    LEASE_LOST = "lease-lost"  # the lease was reaped meanwhile: another delivery owns the job
    CANCELLED = "cancelled"  # asked to abort while it ran: stopped for good, never retried

    @property
    def label(self) -> str:
        """The word people read for this outcome in worker lines and logs (the value stays the
        API's): completed, retrying, failed, rejected, skipped, lost."""
        return _LABELS[self]


_LABELS = {
    Outcome.EMPTY: "empty",
    Outcome.ACKED: "completed",
    Outcome.REQUEUED: "retrying",
    Outcome.DEAD_LETTERED: "failed",
    Outcome.REJECTED: "rejected",
    Outcome.SKIPPED_IDEMPOTENT: "skipped",
    Outcome.LEASE_LOST: "lost",
    Outcome.CANCELLED: "cancelled",
}
# The label of a requeue that did not count a run: the job did not run, because its
# idempotency key or single-instance lock was held by another delivery, or a limit held it.
DEFERRED = "deferred"
# The label of a run ended by a stop at once (a second SIGINT): handed back, not counted.
INTERRUPTED_LABEL = "interrupted"
# Why: the error it is handed back with.
INTERRUPTED = "the worker was stopped at once (a second SIGINT); the run was handed back without counting it"


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """What one delivery did. ``attempt`` is the 1-based run number."""

    status: Outcome
    job_id: str | None = None
    attempt: int | None = None
    error: str | None = None
    queue: str | None = None
    handler: str | None = None
    seconds: float = 0.0
    # What the run raised (for tests that re-raise it); not part of the result's value.
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    # A failed run requeued for another: seconds until it is due, and the most runs it may have.
    retry_in: float | None = None
    max_runs: int | None = None
    # Deferred by a rate or concurrency limit: the limit's hold (its key and the delay).
    hold: Hold | None = None

    @property
    def label(self) -> str:
        """What people read (:attr:`Outcome.label`); a requeue that counted no run (``retry_in``
        is set only for a counted one) is ``deferred``, or ``interrupted`` when a stop at once
        ended its run."""
        if self.status is Outcome.REQUEUED and self.retry_in is None:
            return INTERRUPTED_LABEL if isinstance(self.exception, WorkerInterrupted) else DEFERRED
        return Outcome(self.status).label


@dataclass(slots=True)
class Verdict:
    """What to tell the backend about a delivery: the outcome and what goes with it. Never
    changed once made (not frozen: a frozen dataclass costs each delivery its field checks)."""

    outcome: Outcome
    error: str | None = None
    delay: float = 0.0
    count_run: bool = True  # the delivery ran the handler (or lost a run): ``attempts`` grows
    seconds: float = 0.0
    counter: str | None = None  # for rejections: which ``jobs_rejected_*`` counter
    exception: BaseException | None = None  # what the run raised
    started_at: datetime | None = None  # when the run began (for the attempt history)
    value: Any = None  # what the run returned (kept when the job asks for its result)
    handler: Any = None  # the handler that ran (the sender of the job signals)
    requested_by: str | None = None  # who asked to abort a cancelled run
    hold: Hold | None = None  # a limit deferred the start
    amends: bool = False  # its row replaces the ``retrying`` row written before a refused requeue


class JobContext:
    """The running job: its envelope, the attempt number and the time left. Passed to
    ``JOBS["HANDLERS"]`` handlers; any job (a ``@job`` or ``@task`` function too) reads it with
    :func:`django_jobs.current_job`.

    ``aborted`` becomes ``True`` when the job is asked to abort (its worker's heartbeat learns
    of it): a job that checks it can stop cleanly before ``ABORT_GRACE`` runs out and
    ``JobAborted`` is raised inside it. However it ends, the run is settled ``cancelled``.

    ``parent_result`` is what the parent named by ``options["result_of"]`` returned (a step of
    ``chain(..., pass_result=True)``; a ``@job`` function gets it as its first argument);
    ``None`` otherwise, or when that parent did not complete or kept no result."""

    __slots__ = ("aborted", "attempt", "deadline", "envelope", "lease", "parent_result")

    def __init__(self, envelope: Envelope, attempt: int, deadline: float | None, lease: Lease) -> None:
        self.envelope, self.attempt, self.deadline, self.lease = envelope, attempt, deadline, lease
        self.aborted = False
        self.parent_result: Any = None

    @property
    def payload(self) -> Any:
        return self.envelope.payload

    @property
    def job_id(self) -> str:
        return self.envelope.id

    def remaining(self) -> float | None:
        """Seconds left before the attempt's timeout, or ``None`` when unlimited."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)


def format_error(exc: BaseException) -> str:
    """``ExceptionClass: message`` followed by the traceback, bounded in size.

    Never raises: an exception whose ``__str__`` fails is still described.
    """
    try:
        message, plain = str(exc), True
    except Exception as broken:  # noqa: BLE001 - describing the error must not become one
        message, plain = f"<unprintable {type(exc).__name__}: str() raised {type(broken).__name__}>", False
    trace = _lone_traceback(exc, message) if plain else None
    if trace is None:
        trace = "".join(_plain(traceback.TracebackException.from_exception(exc)).format())
    text = storable(f"{type(exc).__name__}: {message}\n" + trace)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 20] + "\n... (truncated)"


# Exceptions whose last line Python adds to (a "Did you mean" hint, a syntax error's place).
_ANNOTATED = (AttributeError, ImportError, NameError, SyntaxError)


def _lone_traceback(exc: BaseException, message: str) -> str | None:
    """What ``_plain(TracebackException(exc)).format()`` gives for the common failure, read from
    the frames without ``traceback``'s work per frame (positions, a summary object): one
    exception, no chain, group or notes, no repeated frame. ``None`` for any other (``format_error``
    then asks ``traceback``)."""
    if (
        exc.__cause__ is not None
        or (exc.__context__ is not None and not exc.__suppress_context__)
        or isinstance(exc, (BaseExceptionGroup, *_ANNOTATED))
        or getattr(exc, "__notes__", None) is not None
        or hasattr(sys, "tracebacklimit")
    ):
        return None
    lines, last, repeats = ["Traceback (most recent call last):\n"], None, 0
    tb = exc.__traceback__
    while tb is not None:
        code, lineno = tb.tb_frame.f_code, tb.tb_lineno
        where = (code.co_filename, lineno, code.co_name)
        repeats = repeats + 1 if where == last else 0
        if repeats >= 3 or lineno is None:  # traceback folds a repeated frame; a frame without a line
            return None
        last = where
        lines.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
        source = linecache.getline(code.co_filename, lineno).strip()
        if source:
            lines.append(f"    {source}\n")
        tb = tb.tb_next
    kind = type(exc)
    name = (
        kind.__qualname__ if kind.__module__ in ("__main__", "builtins") else f"{kind.__module__}.{kind.__qualname__}"
    )
    lines.append(f"{name}: {message}\n" if message else f"{name}\n")
    return "".join(lines)


class _NoCarets(traceback.StackSummary):
    """Frames as ``File ..., line ..., in ...`` and their source line, without the ``^^^``
    markers, which Python works out by parsing each line again (most of a failure's cost)."""

    def format_frame_summary(self, frame_summary: traceback.FrameSummary, **kwargs: Any) -> str:
        where = f'  File "{frame_summary.filename}", line {frame_summary.lineno}, in {frame_summary.name}\n'
        line = (frame_summary.line or "").strip()
        return where + (f"    {line}\n" if line else "")


def _plain(error: traceback.TracebackException) -> traceback.TracebackException:
    """``error`` with every stack of its chain (causes, contexts, groups) formatted plainly."""
    todo, seen = [error], set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack.__class__ = _NoCarets
        todo += [e for e in (current.__cause__, current.__context__, *(current.exceptions or ())) if e is not None]
    return error


@dataclass(slots=True)
class Delivery:
    """One trusted delivery on its way through the pipeline."""

    lease: Lease
    env: Envelope
    handler: registry.Handler
    pid: int = field(default_factory=os.getpid)  # the process that claimed it, and alone settles it
    started_at: datetime | None = None  # set when the handler is called
    keep_alive: list[Callable[[], None]] = field(default_factory=list)  # renewed with the lease
    on_success: list[Callable[[], None]] = field(default_factory=list)  # before the ack
    release: list[Callable[[], None]] = field(default_factory=list)  # after any ending
    # Who asked to abort the job, once its worker learned of it (the heartbeat thread, or the
    # start check): before its run, it does not start; during it, ``limit.aborted_by`` says so.
    aborted_by: str | None = None
    # From just before the run: its context and time limit, which an abort reaches.
    context: JobContext | None = None
    limit: TimeLimit | None = None
    # It holds concurrency slots, or was parked by a full limit: release_limits after any ending.
    limited: bool = False

    @property
    def attempt(self) -> int:
        return self.env.attempts + 1


class DeliveryPipeline:
    """Takes one fetched lease through verify, guards, run, retry decision and settle."""

    def __init__(
        self,
        backend: QueueBackend,
        *,
        metrics: MetricsCollector | None = None,
        heartbeat: Heartbeat | None = None,
        busy_delay: float = 1.0,
    ) -> None:
        self.backend = backend
        self.metrics = metrics or get_collector()
        self.heartbeat = heartbeat
        self.busy_delay = busy_delay
        self.lease_seconds = float(conf.get("LEASE_TIMEOUT"))
        registry.autodiscover()  # @job handlers register on import; cheap once imported
        # How a success is acked: the run loop swaps in an ack that also leases the next job.
        self.ack: Callable[[Lease], None] = backend.ack
        # Told when a settle hit a backend error (the run loop holds its reaping back then).
        self.on_backend_error: Callable[[], None] | None = None
        # Renewed on every beat of every delivery (the run loop's jobs claimed ahead).
        self.keep_alive: list[Callable[[], None]] = []
        # Told of a lease just before its handler is called (the run loop records the start).
        self.on_start: Callable[[Lease], None] | None = None
        # Takes a failed run's requeue and its attempt row to write with its batch, the row
        # first (``True``), or leaves them to be written now (``False``), the row first too; set
        # by the run loop where the backend batches requeues.
        self.requeue_later: Callable[[Lease, Verdict, dict[str, Any]], bool] | None = None
        # Writes attempt-history rows; the run loop swaps in its batch's writer, which writes
        # the rows it keeps first.
        self.record: Callable[[list[dict[str, Any]]], None] = self.record_now
        # The worker is stopping at once (QueueWorker.interrupt): a run does not begin, and one
        # that ends with an error is handed back without counting it.
        self.interrupted = False
        # Settles an outage kept from the backend, tried again first once it answers
        # (:meth:`settle_unsettled`): kept only while the run loop sets ``keep_unsettled``.
        self.keep_unsettled = False
        self.unsettled: deque[tuple[Lease, Verdict]] = deque()
        self._settling_unsettled = False  # a kept settle that fails again is logged at DEBUG

    # -- the pipeline --

    def process(self, lease: Lease) -> WorkerResult:
        """Verify, run and settle one fetched lease. A job's own failure never raises; only an
        unreachable backend does (the lease is then left for the reaper)."""
        self.metrics.increment("jobs_fetched", queue=lease.queue)
        delivery, verdict = self._admit(lease)
        if delivery is None:
            return self.settle(lease, verdict)
        if self.heartbeat is not None:
            self.heartbeat.watch(lease, delivery.keep_alive, lambda who: self._on_abort(delivery, who))
        try:
            try:
                verdict = self._guarded_run(delivery)
            except Exception as exc:  # noqa: BLE001 - logged by _not_started or _broken
                verdict = (
                    self._not_started(delivery, exc) if delivery.started_at is None else self._broken(delivery, exc)
                )
            if self.heartbeat is not None:
                self.heartbeat.settling()
            return self.settle(lease, verdict, on_success=delivery.on_success)
        finally:
            if self.heartbeat is not None:
                self.heartbeat.clear(lease)
            for release in delivery.release:
                _quietly(release, "release a guard")
            if delivery.limited:
                self._release_limits(delivery)

    def _admit(self, lease: Lease) -> tuple[Delivery | None, Verdict]:
        """Verify before trusting any field, including the queue the message claims."""
        env = lease.envelope
        if env is None:
            return None, _rejection(lease.error or InvalidPayload("undecodable message"), "jobs_rejected_payload")
        try:
            signing.verify_delivery(env, lease.queue)
        except BadSignature as exc:
            return None, _rejection(exc, "jobs_rejected_signature")
        except InvalidPayload as exc:  # fields no JSON encoder accepts (inf, lone surrogates)
            return None, _rejection(exc, "jobs_rejected_payload")
        if not may_run(env.attempts, env.max_retries):
            # The broker's delivery count says earlier deliveries were lost: the budget is spent.
            lost = f"WorkerLost: delivered {env.attempts} times, max_retries={env.max_retries}"
            return None, Verdict(Outcome.DEAD_LETTERED, lost, count_run=False)
        try:
            handler = registry.resolve(env.handler, lease.queue)
        except HandlerNotAllowed as exc:
            return None, _rejection(exc, "jobs_rejected_handler")
        return Delivery(lease, env, handler, keep_alive=list(self.keep_alive)), _ADMITTED

    def _guarded_run(self, d: Delivery) -> Verdict:
        held = self._take_guards(d)
        if held is not None:
            return held
        if not self._still_held(d):
            return self._lost_before_start(d)
        limits = limits_for(d.env.handler, d.lease.queue)
        if limits:
            held = self._acquire(d, limits)
            if held is not None:
                return held
        return self._run(d)

    def _not_started(self, d: Delivery, exc: Exception) -> Verdict:
        """An error before the handler was called (the lease check, a guard's cache, the limits,
        the parent's result: the backend, most often): no run happened, so none is counted. The
        job goes back after the busy delay, on a fresh connection."""
        self.metrics.increment("jobs_backend_errors", queue=d.lease.queue)
        logger.error(
            "job %s: error before it started; handing it back, not counted as a run",
            d.env.id,
            exc_info=exc,
            extra=lease_fields(d.lease, d.attempt, DEFERRED),
        )
        self.backend.reset_connection()
        if self.on_backend_error is not None:
            self.on_backend_error()
        return Verdict(Outcome.REQUEUED, format_error(exc), delay=self.busy_delay, count_run=False, exception=exc)

    def _broken(self, d: Delivery, exc: Exception) -> Verdict:
        """An error in the worker's own code after the handler was called: a failed run."""
        logger.exception(
            "job %s: error in the worker around the job; settling it as a failed run",
            d.env.id,
            extra=lease_fields(d.lease, d.attempt),
        )
        return self._failed(d, exc, seconds=0.0)

    def _lost_before_start(self, d: Delivery) -> Verdict:
        logger.warning(
            "job %s lost: its lease was lost before it could start; not running it",
            d.env.id,
            extra=lease_fields(d.lease, d.attempt, Outcome.LEASE_LOST.label),
        )
        return Verdict(Outcome.LEASE_LOST, count_run=False)

    def _acquire(self, d: Delivery, limits: tuple[Limit, ...]) -> Verdict | None:
        """Take a start under the job's limits; a verdict means: do not run (deferred, or failed
        unrun where the backend cannot enforce limits: never run unlimited)."""
        if not self.backend.supports_limits:
            exc = LimitsNotSupported(
                f"job is limited ({describe(limits)}) and backend {self.backend.name!r} cannot enforce limits; "
                "not running it unlimited"
            )
            return Verdict(Outcome.DEAD_LETTERED, f"LimitsNotSupported: {exc}", count_run=False, exception=exc)
        try:
            hold = self.backend.acquire(d.lease, limits)
        except LeaseLost:
            return self._lost_before_start(d)
        # Released after the settle: slots taken, or (parked) to look for room once requeued.
        d.limited = hold.parked if hold is not None else any(limit.concurrency is not None for limit in limits)
        if hold is None:
            return None
        self.metrics.observe("jobs_limit_wait_seconds", hold.delay, limit=hold.key)
        return Verdict(Outcome.REQUEUED, delay=hold.delay, count_run=False, hold=hold)

    def _release_limits(self, d: Delivery) -> None:
        if d.limited:
            d.limited = False
            _quietly(lambda: self.backend.release_limits(d.lease), "release the job's limits")

    def _take_guards(self, d: Delivery) -> Verdict | None:
        """The idempotency key and the single-instance lock; a verdict means: do not run."""
        env, owner = d.env, d.lease.owner_token
        if env.idempotency_key:
            guard, key = IdempotencyGuard(), env.idempotency_key
            claim = guard.claim(key, owner, self.lease_seconds)
            if claim is Claim.DONE:
                return Verdict(Outcome.SKIPPED_IDEMPOTENT, count_run=False)
            if claim is Claim.BUSY:
                return self._busy()
            hold = _KeyHold(guard, key, owner)
            d.keep_alive.append(lambda: guard.extend(key, owner, self.lease_seconds))
            d.on_success.append(hold.succeeded)
            d.release.append(hold.release)
        if env.options.get("single_instance"):
            lock = CacheLock(f"django_jobs:single:{env.handler}", owner, self.lease_seconds)
            if not lock.acquire():
                return self._busy()
            d.keep_alive.append(lock.extend)
            d.release.append(lock.release)
        return None

    def _busy(self) -> Verdict:
        """Another delivery holds this job's key or lock: try again later, not counted as a run."""
        return Verdict(Outcome.REQUEUED, delay=self.busy_delay, count_run=False)

    def _still_held(self, d: Delivery) -> bool:
        """Is the lease still ours? Proven by a fenced extend when much of it has passed (the
        guards stalled, or the process was frozen), so a reaped job never starts here. An abort
        that extend finds keeps the job from starting."""
        lease = d.lease
        if self.heartbeat is not None and self.heartbeat.lost(lease):
            return False
        if lease.must_begin:  # claimed ahead after a lost claim: its start is recorded first
            renew = self.backend.begin
        elif lease.seconds_left() > self.lease_seconds / 2:
            return True
        else:
            renew = self.backend.extend
        try:
            aborted_by = renew(lease, self.lease_seconds)
        except LeaseLost:
            return False
        if aborted_by:
            self._on_abort(d, aborted_by)
        return True

    def _run(self, d: Delivery) -> Verdict:
        env, queue = d.env, d.lease.queue
        timeout = env.timeout if env.timeout is not None else conf.get("DEFAULT_TIMEOUT")
        ready_since = env.available_at.timestamp() if env.available_at else seconds_of(env.id)  # due, or sent
        if ready_since is not None:
            self.metrics.observe("jobs_wait_seconds", max(time.time() - ready_since, 0.0), queue=queue)
        start = time.monotonic()
        deadline = start + timeout if timeout else None
        # Published before the check: an abort the heartbeat passes on from here reaches the run.
        d.context = context = JobContext(env, d.attempt, deadline, d.lease)
        d.limit = limit = TimeLimit(timeout)
        if d.aborted_by is not None:  # asked before it started: it does not run
            limit.end()
            if self.heartbeat is not None:
                self.heartbeat.disarm()
            return self._cancelled(d, d.aborted_by, None, 0.0, count_run=False)
        parent = env.options.get("result_of")
        if parent is not None:  # a chain's step: what the previous one returned (it is stored)
            context.parent_result = self.backend.stored_result(str(parent))
        if deadline is not None and self.heartbeat is not None:
            # An abort's own deadline may be armed already: the earlier one stands.
            self.heartbeat.arm(deadline + HARD_TIMEOUT_GRACE, lambda: self.settle_timed_out(d), earliest=True)
        if self.on_start is not None:
            self.on_start(d.lease)
        d.started_at = timezone.now()
        emit(job_started, d.handler, envelope=env, attempt=d.attempt, context=context)
        error: BaseException | None
        try:
            if self.interrupted:  # stopped at once as it was about to begin
                limit.end()
                error, value = WorkerInterrupted(INTERRUPTED), None
            else:
                error, value = _call(d, context, limit)
            if error is None and env.options.get("keep_result"):
                error = _unstorable(value)
        finally:
            if self.heartbeat is not None:  # after the limit ended: an abort arms nothing now
                self.heartbeat.disarm()
        seconds = time.monotonic() - start
        _drop_broken_connections()
        self.metrics.observe("jobs_exec_seconds", seconds, queue=queue)
        if limit.aborted_by is not None:  # the abort reached the run before it ended
            return self._cancelled(d, limit.aborted_by, error, seconds)
        if error is not None and self.interrupted:
            return self._interrupted(d, error, seconds)
        if error is None:
            return Verdict(Outcome.ACKED, seconds=seconds, started_at=d.started_at, value=value, handler=d.handler)
        return self._failed(d, error, seconds)

    # -- the retry decision --

    def _failed(self, d: Delivery, exc: BaseException, seconds: float) -> Verdict:
        """A failed run: requeued with backoff while the budget and the policy allow, else failed."""
        for release in d.release:  # free the key first, so the retry is not held back by it
            _quietly(release, "release a guard")
        d.release.clear()
        self.metrics.increment("jobs_failed", queue=d.lease.queue)
        env, text = d.env, format_error(exc)
        can = has_retries_left(env.attempts, env.max_retries) and self.backend.supports_retry
        retry = can and self._may_retry(d, exc)
        votes = emit(job_failed, d.handler, envelope=env, attempt=d.attempt, exception=exc, will_retry=retry)
        if any(vote is False for vote in votes):
            retry = False
        elif any(vote is True for vote in votes) and can and not isinstance(exc, PERMANENT_ERRORS):
            retry = True
        outcome, delay = Outcome.DEAD_LETTERED, 0.0
        if retry:
            outcome, delay = Outcome.REQUEUED, policy_for(env.options).compute_delay(env.attempts + 2)
        return Verdict(
            outcome, text, delay=delay, seconds=seconds, exception=exc, started_at=d.started_at, handler=d.handler
        )

    def _may_retry(self, d: Delivery, exc: BaseException) -> bool:
        if isinstance(exc, PERMANENT_ERRORS):
            return False
        retry_on = d.env.options.get("retry_on")
        if retry_on:
            names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
            if not names.intersection(retry_on):
                return False
        can_retry = getattr(d.handler, "can_retry", None)
        if can_retry is not None:
            try:
                return bool(can_retry(d.attempt, exc))
            except Exception:
                logger.exception(
                    "job %s: can_retry() raised; not retrying", d.env.id, extra=lease_fields(d.lease, d.attempt)
                )
                return False
        return True

    def _interrupted(self, d: Delivery, exc: BaseException, seconds: float) -> Verdict:
        """A run that a stop at once ended (with :class:`WorkerInterrupted`, or whatever the
        job raised instead): the job goes back to its queue, due at once, its runs not counted."""
        if not isinstance(exc, WorkerInterrupted):
            interrupted = WorkerInterrupted(INTERRUPTED)
            interrupted.__cause__, exc = exc, interrupted
        return Verdict(
            Outcome.REQUEUED,
            f"WorkerInterrupted: {INTERRUPTED}",
            count_run=False,
            seconds=seconds,
            exception=exc,
            started_at=d.started_at,
            handler=d.handler,
        )

    # -- aborting --

    def _on_abort(self, d: Delivery, requested_by: str) -> None:
        """The job was asked to abort (the heartbeat thread, or the start check). Before its
        run, it does not start. During it, its context says so at once, ``JobAborted`` is raised
        in it after ``ABORT_GRACE``, and if it is still running ``HARD_TIMEOUT_GRACE`` after
        that, it is settled cancelled and the process ends, as on a hard timeout. After its run
        it is too late: the run stands as it ended."""
        d.aborted_by = requested_by  # first: the start check reads it after publishing the limit
        limit, context = d.limit, d.context
        if limit is None or context is None:
            return  # before the run: _run sees it and does not start the job
        grace = float(conf.get("ABORT_GRACE"))

        def stop() -> None:  # while the run has not ended (under the limit's lock)
            context.aborted = True
            if self.heartbeat is not None:
                kill_at = time.monotonic() + grace + HARD_TIMEOUT_GRACE
                self.heartbeat.arm(kill_at, lambda: self.settle_aborted(d), earliest=True)

        if limit.abort(requested_by, grace, stop):
            logger.warning(
                "job %s: %s; stopping it",
                d.env.id,
                JobAborted.describe(requested_by),
                extra=lease_fields(d.lease, d.attempt),
            )

    def _cancelled(
        self, d: Delivery, who: str, exc: BaseException | None, seconds: float, *, count_run: bool = True
    ) -> Verdict:
        """An aborted run, however it ended: cancelled for good, whatever retries it had left.
        Its error says who asked, then what ended it (``exc``: ``JobAborted``, or its own error)."""
        detail = "" if exc is None else format_error(exc)
        verdict = abort_verdict(who, count_run=count_run, exception=exc, handler=d.handler, detail=detail)
        return replace(verdict, seconds=seconds, started_at=d.started_at)

    def cancel_unstarted(self, lease: Lease, requested_by: str) -> WorkerResult:
        """A job held ahead of its run that was asked to abort (its hand-back was refused):
        settle it cancelled, not run."""
        return self.settle(lease, abort_verdict(requested_by, count_run=False))

    def settle_aborted(self, d: Delivery) -> None:
        """Heartbeat thread: the aborted job ignored ``JobAborted``; settle it as cancelled
        (the process then ends)."""
        exc = JobAborted(f"did not stop {HARD_TIMEOUT_GRACE:g}s after the abort grace and was killed")
        logger.critical(
            "job %s is stuck past its abort grace; settling it as cancelled",
            d.env.id,
            extra=lease_fields(d.lease, d.attempt),
        )
        self.settle(d.lease, self._cancelled(d, d.aborted_by or "unknown", exc, seconds=0.0), retries=())
        self._release_limits(d)

    def settle_timed_out(self, d: Delivery) -> None:
        """Heartbeat thread: the attempt ignored its soft timeout; settle it as a failed run
        (as cancelled, when it was asked to abort)."""
        if d.limit is not None and d.limit.aborted_by is not None:
            self.settle_aborted(d)
            return
        exc = JobTimeout(f"attempt exceeded its timeout by {HARD_TIMEOUT_GRACE:g}s and was killed")
        logger.critical(
            "job %s is stuck past its timeout; settling it as failed", d.env.id, extra=lease_fields(d.lease, d.attempt)
        )
        # Now, not with a batch: the process ends next, and its requeue would never be written.
        self.settle(d.lease, self._failed(d, exc, seconds=0.0), retries=(), batched=False)
        self._release_limits(d)

    # -- settling --

    def settle(
        self,
        lease: Lease,
        verdict: Verdict,
        *,
        on_success: list[Callable[[], None]] | None = None,
        retries: tuple[float, ...] = SETTLE_RETRY_PAUSES,
        batched: bool = True,
    ) -> WorkerResult:
        """Tell the backend, count it, and build the result. ``LeaseLost`` -> ``lease-lost``.
        ``batched``: a failed run's requeue may wait for its batch (:attr:`requeue_later`)."""
        outcome, env, queue = verdict.outcome, lease.envelope, lease.queue
        if outcome is Outcome.REJECTED or env is None:
            job_id, attempt = lease.token, None
        else:
            job_id, attempt = env.id, env.attempts + int(verdict.count_run)
        if outcome is Outcome.LEASE_LOST:  # found before the run: nothing to tell the backend
            self.metrics.increment("jobs_lease_lost", queue=queue)
        else:
            try:
                try:
                    now = self._tell_backend(lease, verdict, on_success or (), retries, batched)
                except AbortRequested as asked:  # a requeue refused: the job was asked to abort
                    verdict = _instead_of_requeue(verdict, asked.requested_by, verdict.count_run)
                    outcome = verdict.outcome
                    now = self._tell_backend(lease, verdict, (), retries, batched)
            except LeaseLost as lost:
                self.metrics.increment("jobs_lease_lost", queue=queue)
                logger.warning(
                    "job %s lost: its lease was lost before it could be settled as %s%s",
                    job_id,
                    _verdict_label(verdict),
                    MAYBE_SETTLED if lost.after_failed_try else "",
                    extra=lease_fields(lease, attempt, Outcome.LEASE_LOST.label),
                )
                outcome = Outcome.LEASE_LOST
            except Exception as exc:
                self._keep_unsettled(lease, verdict, exc)
                raise
            else:
                if now:  # else counted once its batch has written it (``requeued``)
                    self._count(lease, verdict)
                    self._recorded(lease, verdict)
        retried = outcome is Outcome.REQUEUED and verdict.count_run
        result = WorkerResult(
            outcome,
            job_id=job_id,
            attempt=attempt,
            error=verdict.error,
            queue=queue,
            handler=env.handler if env is not None else None,
            seconds=verdict.seconds,
            exception=verdict.exception,
            retry_in=verdict.delay if retried else None,
            max_runs=env.max_retries + 1 if retried and env is not None else None,
            hold=verdict.hold,
        )
        if outcome is not Outcome.LEASE_LOST:  # a lost lease is logged where it was found
            _log_result(lease, result)
        return result

    def _keep_unsettled(self, lease: Lease, verdict: Verdict, error: Exception) -> None:
        """A settle that outlasted its retries: kept, while the run loop asks for it, to be tried
        again before anything else once the backend answers, so that its lease, still ours
        while the reapers hold back after the outage, is settled as the run ended, not reaped
        as lost (a success run again, or failed ``WorkerLost``). Only for an outage (an error
        the backend's client raises when its server cannot be reached): any other would fail
        the same way again, and hold the worker. Not a failed run's requeue whose attempt row
        is written already: the reaper counts that run once."""
        if not self.keep_unsettled or (verdict.outcome is Outcome.REQUEUED and verdict.count_run):
            return
        if not isinstance(self.backend.dispatch_error(error), BackendUnavailable):
            return
        self.unsettled.append((lease, verdict))
        logger.log(
            logging.DEBUG if self._settling_unsettled else logging.ERROR,  # the 1st failure says it
            "job %s: could not settle it as %s; trying again once the backend answers",
            lease.envelope.id if lease.envelope is not None else lease.token,
            _verdict_label(verdict),
            extra=lease_fields(lease),
        )

    def settle_unsettled(self) -> None:
        """Settle what an outage kept from the backend, oldest first, one try each: a backend
        error keeps the rest, and is raised (the run loop waits for the backend)."""
        self._settling_unsettled = True
        try:
            while self.unsettled:
                lease, verdict = self.unsettled.popleft()
                self.settle(lease, verdict, retries=(), batched=False)
        finally:
            self._settling_unsettled = False

    def _tell_backend(
        self,
        lease: Lease,
        verdict: Verdict,
        on_success: Iterable[Callable[[], None]],
        retries: tuple[float, ...],
        batched: bool,
    ) -> bool:
        """Settle with the backend; ``False`` when a failed run's requeue waits for its batch
        (:attr:`requeue_later`)."""
        outcome, count_run = verdict.outcome, verdict.count_run
        if outcome is Outcome.ACKED:
            if lease.envelope is not None and lease.envelope.options.get("keep_result"):
                lease.result = verdict.value
                # Before the ack, which forgets a broker's message: a worker killed between the
                # two leaves the result kept and the job to run again, not a job of no record.
                _quietly(lambda: self.backend.keep_result(lease, verdict.value), "keep the job's result")
            for hook in on_success:  # before the ack: if the ack finds the lease lost, the redelivery is skipped
                _quietly(hook, "mark the idempotency key done")
            self.retrying(self.ack, retries, lease)
        elif outcome is Outcome.SKIPPED_IDEMPOTENT:
            self.retrying(self.backend.ack, retries, lease, count_run=False)
        elif outcome is Outcome.REQUEUED:
            if count_run and lease.envelope is not None:
                # The retry must not be claimable before the row of this run exists.
                row = self._attempt(lease.envelope, AttemptOutcome.RETRYING, verdict)
                if batched and self.requeue_later is not None and self.requeue_later(lease, verdict, row):
                    return False
                self.record([row])
            self.retrying(
                self.backend.nack, retries, lease, verdict.delay, error=verdict.error or "", count_run=count_run
            )
        elif outcome is Outcome.CANCELLED:
            self.retrying(self.backend.cancel, retries, lease, verdict.error or "", count_run=count_run)
        else:  # DEAD_LETTERED or REJECTED
            self.retrying(self.backend.abandon, retries, lease, verdict.error or "", count_run=count_run)
        return True

    def requeued(self, done: list[tuple[Lease, Verdict]]) -> None:
        """Failed runs whose requeues a batch wrote (:attr:`requeue_later`): counted now (their
        rows were written before the requeues)."""
        for lease, verdict in done:
            self._count(lease, verdict)

    def requeue_refused(self, lease: Lease, verdict: Verdict, requested_by: str) -> None:
        """A failed run's requeue that its batch found refused (the job was asked to abort while
        it ran): settled cancelled instead, its error kept, its row written over the
        ``retrying`` one. Never raises (the reaper settles a cancel that could not be made)."""
        cancelled = _instead_of_requeue(verdict, requested_by, amends=True)
        _quietly(lambda: self.settle(lease, cancelled), "settle as cancelled a failed run asked to abort")

    def retrying(self, action: Callable[_P, _R], pauses: tuple[float, ...], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """Settle, retrying a transient backend error a few times within the lease
        (:func:`~django_jobs.backends.base.retrying_settle`)."""

        def failed(error: Exception, pause: float) -> None:
            lease = next((a for a in args if isinstance(a, Lease)), None)
            extra = lease_fields(lease) if lease is not None else log_fields(None, None)
            # A try again at once, on fresh connections, is routine (a stale pooled connection).
            level = logging.WARNING if pause else logging.DEBUG
            logger.log(
                level,
                "settle failed (%s); retrying in %gs",
                summary(error),
                pause,
                exc_info=debug_traceback(logger, error),
                extra=extra,
            )
            self.metrics.increment("jobs_backend_errors", queue=lease.queue if lease is not None else "*")
            if self.on_backend_error is not None:
                self.on_backend_error()

        return retrying_settle(self.backend, lambda: action(*args, **kwargs), failed, pauses)

    def _recorded(self, lease: Lease, verdict: Verdict) -> None:
        """After a settle: the result and the attempt history, then the signals."""
        outcome, env = verdict.outcome, lease.envelope
        if outcome is Outcome.REJECTED or env is None:
            emit(job_rejected, self.backend, message_id=lease.token, queue=lease.queue, reason=verdict.error or "")
            return
        attempt = env.attempts + 1
        if outcome is Outcome.ACKED:
            if env.options.get("keep_result"):
                self._history(env, AttemptOutcome.COMPLETED, verdict)
            emit(job_succeeded, verdict.handler, envelope=env, attempt=attempt,
                 result=verdict.value, seconds=verdict.seconds)  # fmt: skip
        elif outcome is Outcome.CANCELLED:
            row = self._attempt(env, AttemptOutcome.CANCELLED, verdict, verdict.requested_by)
            if verdict.amends:
                history.amend(row, self.backend.history_alias)
            else:
                self.record([row])
        elif outcome is Outcome.DEAD_LETTERED:
            if verdict.count_run:
                self._history(env, AttemptOutcome.FAILED, verdict)
            runs = env.attempts + int(verdict.count_run)
            emit(job_dead_lettered, verdict.handler or env.handler, envelope=env, error=verdict.error or "",
                 attempts=runs, exception=verdict.exception)  # fmt: skip

    def record_now(self, rows: list[dict[str, Any]]) -> None:
        """Write attempt-history rows now (:attr:`record` outside a run's batches)."""
        history.record_many(rows, using=self.backend.history_alias)

    def _history(self, env: Envelope, outcome: str, verdict: Verdict, worker: str | None = None) -> None:
        self.record([self._attempt(env, outcome, verdict, worker)])

    @staticmethod
    def _attempt(env: Envelope, outcome: str, verdict: Verdict, worker: str | None = None) -> dict[str, Any]:
        """The attempt-history row of the run of ``env`` that ``verdict`` settled."""
        exc = verdict.exception
        error_class = storable(history.error_class(exc)) if exc is not None else ""
        return history.attempt_row(
            env.id,
            env.attempts + 1,
            outcome,
            started_at=verdict.started_at,
            error=verdict.error or "",
            error_class=error_class,
            worker=worker,
        )

    def _count(self, lease: Lease, verdict: Verdict) -> None:
        queue, outcome, env = lease.queue, verdict.outcome, lease.envelope
        if outcome is Outcome.ACKED:
            self.metrics.increment("jobs_succeeded", queue=queue)
        elif outcome is Outcome.SKIPPED_IDEMPOTENT:
            self.metrics.increment("jobs_skipped_idempotent", queue=queue)
        elif outcome is Outcome.REQUEUED and verdict.count_run:
            self.metrics.increment("jobs_requeued", queue=queue)
            self.metrics.observe("jobs_retry_delay_seconds", verdict.delay, queue=queue)
        elif outcome is Outcome.REJECTED:
            self.metrics.increment(verdict.counter or "jobs_rejected_payload", queue=queue)
        elif outcome is Outcome.DEAD_LETTERED and env is not None:
            self.metrics.increment("jobs_failed_permanently", queue=queue)
        elif outcome is Outcome.CANCELLED:
            self.metrics.increment("jobs_aborted", queue=queue)


class _KeyHold:
    """This delivery's hold on its idempotency key: consumed by a success, else released."""

    __slots__ = ("done", "guard", "key", "owner")

    def __init__(self, guard: IdempotencyGuard, key: str, owner: str) -> None:
        self.guard, self.key, self.owner, self.done = guard, key, owner, False

    def succeeded(self) -> None:
        self.guard.succeeded(self.key)
        self.done = True

    def release(self) -> None:
        if not self.done:
            self.guard.failed(self.key, self.owner)


def _call(d: Delivery, context: JobContext, limit: TimeLimit) -> tuple[BaseException | None, Any]:
    """Run the handler once; return what it raised, or ``None`` and what it returned (an
    awaitable it returns is run to its end: what that returns). Whatever it raises
    (``SystemExit`` and ``KeyboardInterrupt`` included) is the run's failure, not the worker's
    end. A forked child of the job that unwinds out of it exits here, so it never becomes a
    second worker. Meanwhile :func:`~django_jobs.current_job` returns ``context``."""
    token = running_job.set(context)
    try:
        with limit:
            value = d.handler.handle(context)
            if value is not None and inspect.isawaitable(value):  # an async job: it runs now, to its end
                value = coroutines.run(value, limit)
    except BaseException as exc:  # noqa: BLE001 - see above
        _exit_if_forked(d, exc)
        return exc, None
    finally:
        running_job.reset(token)
    _exit_if_forked(d, None)
    return None, value


def _unstorable(value: Any) -> InvalidPayload | None:
    """Why a job that keeps its result failed to: its return value is not JSON."""
    try:
        check_storable(value, dumps_payload(value))
    except InvalidPayload as exc:
        return InvalidPayload(f"the job's return value cannot be kept: {exc}")
    return None


def _exit_if_forked(d: Delivery, exc: BaseException | None) -> None:
    if os.getpid() == d.pid:
        return
    code = 0 if exc is None else 1
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        _quietly(stream.flush, "flush")
    os._exit(code)


# How loud each ending is logged. A failure or a rejection is an expected end of a job (its
# retries spent, an error no retry can fix, a message that must not run): ERROR. CRITICAL is
# kept for the worker's own emergencies (a job stuck past its timeout).
_LEVELS = {
    Outcome.ACKED: logging.INFO,
    Outcome.REQUEUED: logging.INFO,
    Outcome.SKIPPED_IDEMPOTENT: logging.INFO,
    Outcome.DEAD_LETTERED: logging.ERROR,
    Outcome.REJECTED: logging.ERROR,
    Outcome.CANCELLED: logging.WARNING,
}


def _log_result(lease: Lease, result: WorkerResult) -> None:
    """One record per settled delivery, in the words of :attr:`WorkerResult.label`, with the
    :data:`LOG_FIELDS` as attributes (a failure also carries ``last_error``, the whole error)."""
    status = result.status
    level = _LEVELS.get(status)
    if status is Outcome.REQUEUED and result.label == INTERRUPTED_LABEL:
        level = logging.WARNING
    if level is None or not logger.isEnabledFor(level):  # before any text is made: most are dropped
        return
    label = result.label
    env = lease.envelope
    extra = log_fields(result.job_id, result.queue, result.handler, result.attempt, label)
    first_line = (result.error or "").partition("\n")[0]
    if result.status is Outcome.REJECTED or env is None:
        logger.log(level, "message %s on queue %s %s", lease.token, lease.queue, result.error, extra=extra)
        return
    name = env.name or env.handler
    if result.status is Outcome.DEAD_LETTERED:
        runs = result.attempt if result.attempt is not None else env.attempts
        extra["last_error"] = result.error or ""
        logger.log(
            level, "job %s (%s) failed permanently after %d run(s): %s", env.id, name, runs, first_line, extra=extra
        )
    elif result.status is Outcome.CANCELLED:
        logger.log(level, "job %s (%s) cancelled: %s", env.id, name, first_line, extra=extra)
    elif label == DEFERRED:
        why = f"error before it started: {first_line}" if result.error else deferral(result.hold)
        logger.log(level, "job %s (%s) deferred: %s", env.id, name, why, extra=extra)
    elif label == INTERRUPTED_LABEL:
        logger.log(level, "job %s (%s) interrupted: %s", env.id, name, INTERRUPTED, extra=extra)
    elif result.status is Outcome.REQUEUED:
        logger.log(
            level, "job %s (%s) retrying in %gs after run %s: %s",
            env.id, name, result.retry_in, result.attempt, first_line, extra=extra,
        )  # fmt: skip
    elif result.status is Outcome.SKIPPED_IDEMPOTENT:
        logger.log(level, "job %s (%s) skipped: its idempotency key already completed", env.id, name, extra=extra)
    else:
        logger.log(level, "job %s (%s) completed in %.3fs", env.id, name, result.seconds, extra=extra)


def deferral(hold: Hold | None) -> str:
    """Why a job was deferred, in words."""
    if hold is None:
        return "its idempotency key or single-instance lock is held by another delivery"
    if hold.parked:
        return f"limit {hold.key} is full; it waits for a running job to end"
    return f"limit {hold.key} allows its start in {hold.delay:.3g}s"


def _verdict_label(verdict: Verdict) -> str:
    """The label of the ending a verdict asked for (a requeue without a run: ``deferred``)."""
    if verdict.outcome is Outcome.REQUEUED and not verdict.count_run:
        return DEFERRED
    return verdict.outcome.label


def abort_verdict(
    who: str, *, count_run: bool, exception: BaseException | None = None, handler: Any = None, detail: str = ""
) -> Verdict:
    """The verdict of a job asked to abort by ``who``: cancelled for good (``detail``: what
    else its last error says, after the first line)."""
    error = JobAborted.describe(who) + (f"\n{detail}" if detail else "")
    return Verdict(
        Outcome.CANCELLED, error, count_run=count_run, exception=exception, handler=handler, requested_by=who
    )


def _instead_of_requeue(verdict: Verdict, who: str, amends: bool) -> Verdict:
    """A requeue the backend refused because the job was asked to abort (the run failed, or was
    deferred, before the heartbeat saw the request): it ends cancelled instead, its error kept
    (``amends``: its row replaces the ``retrying`` one written before the requeue)."""
    instead = abort_verdict(
        who,
        count_run=verdict.count_run,
        exception=verdict.exception,
        handler=verdict.handler,
        detail=verdict.error or "",
    )
    return replace(instead, seconds=verdict.seconds, started_at=verdict.started_at, amends=amends)


# What ``_admit`` says of a trusted delivery (the run decides its real verdict).
_ADMITTED = Verdict(Outcome.ACKED)


def _rejection(exc: JobsError, counter: str) -> Verdict:
    text = f"rejected: {type(exc).__name__}: {exc}"
    return Verdict(Outcome.REJECTED, text, count_run=False, counter=counter, exception=exc)


def _drop_broken_connections() -> None:
    """After a run, as Django does at the end of a request: a database connection of this thread
    on which an error occurred (the job's own queries included) and that no longer answers (a
    restarted server, a killed session) is closed, so the next job connects afresh instead of
    failing on it. Connections that answer stay open; one inside a transaction is left alone."""
    for connection in connections.all(initialized_only=True):
        if connection.connection is None or not connection.errors_occurred or connection.in_atomic_block:
            continue
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            _quietly(connection.close, f"close the broken connection to database {connection.alias!r}")


def _quietly(action: Callable[[], Any], what: str) -> None:
    try:
        action()
    except Exception:
        logger.warning("could not %s", what, exc_info=True)
