"""QueueWorker: fetch -> verify -> run one attempt -> settle. It knows only the backend protocol."""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from . import conf, registry, signing
from .backends import get_backend
from .backends.base import Lease, QueueBackend
from .envelope import Envelope
from .exceptions import BadSignature, HandlerNotAllowed, InvalidPayload, JobsError, JobTimeout, LeaseLost
from .heartbeat import Heartbeat
from .idempotency import Claim, IdempotencyGuard
from .locks import CacheLock
from .metrics import MetricsCollector, get_collector
from .reaper import Reaper
from .retry import policy_for
from .timeouts import HARD_TIMEOUT_GRACE, time_limit

logger = logging.getLogger("django_jobs.worker")

# Failures that no retry can fix.
PERMANENT_ERRORS = (BadSignature, HandlerNotAllowed, InvalidPayload)
MAX_ERROR_CHARS = 20_000
# Exit status of a worker process ended by a hard timeout (the supervisor restarts it).
EXIT_HARD_TIMEOUT = 75


@dataclass(slots=True)
class WorkerResult:
    """What one ``process_once`` did. ``attempt`` is the 1-based run number."""

    status: str  # empty | acked | requeued | dead-lettered | rejected | skipped-idempotent | lease-lost
    job_id: str | None = None
    attempt: int | None = None
    error: str | None = None
    queue: str | None = None
    handler: str | None = None
    seconds: float = 0.0


class JobContext:
    """Passed to handlers: the envelope, the attempt number and the time left."""

    __slots__ = ("envelope", "attempt", "deadline", "lease")

    def __init__(self, envelope: Envelope, attempt: int, deadline: float | None, lease: Lease) -> None:
        self.envelope, self.attempt, self.deadline, self.lease = envelope, attempt, deadline, lease

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
    """``ExceptionClass: message`` followed by the traceback, bounded in size."""
    text = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc))
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 20] + "\n... (truncated)"


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
        registry.autodiscover()  # @job handlers register on import; cheap once imported
        self.metrics = metrics or get_collector()
        self.lease_seconds = float(conf.get("LEASE_TIMEOUT"))
        self.exit_on_hard_timeout = exit_on_hard_timeout
        self.busy_delay = busy_delay
        self.heartbeat = Heartbeat(self.backend, self.lease_seconds, self._hard_timeout)
        self.stopping = False
        # run() lets a successful ack lease the next job in the same round trip (where the backend
        # pipelines it): ``_ready`` is that job; ``_chain`` says whether one may be taken now.
        self._ready: Lease | None = None
        self._chain: tuple[Callable[[], bool], Callable[[], None]] | None = None

    # -- one delivery --

    def process_once(self, queue: str | None = None) -> WorkerResult:
        """Fetch at most one message (from ``queue`` or each worker queue in order) and settle it."""
        ready = self._ready
        if ready is not None and queue in (None, ready.queue):
            self._ready = None
            return self.process(ready)
        for name in (queue,) if queue else self.queues:
            lease = self.backend.fetch(name)
            if lease is not None:
                return self.process(lease)
        return WorkerResult("empty")

    def process(self, lease: Lease) -> WorkerResult:
        """Verify, run and settle one fetched lease. Never raises for a job's own failure."""
        queue = lease.queue
        self.metrics.increment("jobs_fetched", queue=queue)
        env = lease.envelope
        if env is None:
            return self._reject(lease, lease.error or InvalidPayload("undecodable message"), "jobs_rejected_payload")
        # Verify before trusting any field, including the queue the message claims.
        try:
            signing.verify_delivery(env, queue)
        except BadSignature as exc:
            return self._reject(lease, exc, "jobs_rejected_signature")
        except InvalidPayload as exc:  # fields no JSON encoder accepts (inf, lone surrogates)
            return self._reject(lease, exc, "jobs_rejected_payload")
        if env.attempts > env.max_retries:
            # The broker's delivery count says earlier deliveries were lost: the budget is spent.
            return self._dead_letter(
                lease, env, f"WorkerLost: delivered {env.attempts} times, max_retries={env.max_retries}", count_run=False
            )
        try:
            handler = registry.resolve(env.handler, queue)
        except HandlerNotAllowed as exc:
            return self._reject(lease, exc, "jobs_rejected_handler")

        guard = key = None
        keep_alive: list[Callable[[], None]] = []
        if env.idempotency_key:
            guard, key = IdempotencyGuard(), env.idempotency_key
            claim = guard.claim(key, lease.owner_token, self.lease_seconds)
            if claim is Claim.DONE:
                result = self._settle(lease, env, "skipped-idempotent", self.backend.ack, count_run=False)
                self.metrics.increment("jobs_skipped_idempotent", queue=queue)
                return result
            if claim is Claim.BUSY:
                return self._requeue_unrun(lease, env)
            keep_alive.append(lambda: guard.extend(key, lease.owner_token, self.lease_seconds))
        lock = None
        if env.options.get("single_instance"):
            lock = CacheLock(f"django_jobs:single:{env.handler}", lease.owner_token, self.lease_seconds)
            if not lock.acquire():
                if guard and key:
                    guard.failed(key, lease.owner_token)
                return self._requeue_unrun(lease, env)
            keep_alive.append(lock.extend)
        try:
            return self._run(lease, env, handler, guard, key, keep_alive)
        finally:
            if lock is not None:
                lock.release()

    def _run(
        self, lease: Lease, env: Envelope, handler: Any, guard: IdempotencyGuard | None, key: str | None,
        keep_alive: list[Callable[[], None]],
    ) -> WorkerResult:
        attempt = env.attempts + 1
        timeout = env.timeout if env.timeout is not None else conf.get("DEFAULT_TIMEOUT")
        queue = lease.queue
        if env.available_at is not None:
            self.metrics.observe("jobs_wait_seconds", _since(env.available_at), queue=queue)
        start = time.monotonic()
        deadline = start + timeout if timeout else None
        self.heartbeat.watch(lease, deadline + HARD_TIMEOUT_GRACE if deadline else None, keep_alive)
        error: BaseException | None = None
        try:
            with time_limit(timeout):
                handler.handle(JobContext(env, attempt, deadline, lease))
        except (Exception, SystemExit) as exc:  # a job calling sys.exit() must not end the worker
            error = exc
        finally:
            self.heartbeat.clear()
        seconds = time.monotonic() - start
        self.metrics.observe("jobs_exec_seconds", seconds, queue=queue)
        if error is None:
            if guard and key:
                # Before the ack: if the ack finds the lease lost, the redelivery is skipped.
                guard.succeeded(key)
            result = self._settle(lease, env, "acked", self._ack)
            if result.status == "acked":
                self.metrics.increment("jobs_succeeded", queue=queue)
            result.seconds = seconds
            return result
        if guard and key:
            guard.failed(key, lease.owner_token)
        self.metrics.increment("jobs_failed", queue=queue)
        result = self._fail(lease, env, handler, error)
        result.seconds = seconds
        return result

    # -- outcomes --

    def _fail(self, lease: Lease, env: Envelope, handler: Any, exc: BaseException) -> WorkerResult:
        text = format_error(exc)
        if env.attempts < env.max_retries and self.backend.supports_retry and self._may_retry(handler, env, exc):
            delay = policy_for(env.options).compute_delay(env.attempts + 2)
            result = self._settle(lease, env, "requeued", self.backend.nack, delay, error=text)
            if result.status == "requeued":
                self.metrics.increment("jobs_requeued", queue=lease.queue)
                self.metrics.observe("jobs_retry_delay_seconds", delay, queue=lease.queue)
            result.error = text
            return result
        return self._dead_letter(lease, env, text)

    def _may_retry(self, handler: Any, env: Envelope, exc: BaseException) -> bool:
        if isinstance(exc, PERMANENT_ERRORS):
            return False
        retry_on = env.options.get("retry_on")
        if retry_on:
            names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
            if not names.intersection(retry_on):
                return False
        can_retry = getattr(handler, "can_retry", None)
        if can_retry is not None:
            try:
                return bool(can_retry(env.attempts + 1, exc))
            except Exception:
                logger.exception("job %s: can_retry() raised; not retrying", env.id)
                return False
        return True

    def _dead_letter(self, lease: Lease, env: Envelope, text: str, *, count_run: bool = True) -> WorkerResult:
        result = self._settle(lease, env, "dead-lettered", self.backend.abandon, text, count_run=count_run)
        if result.status == "dead-lettered":
            self.metrics.increment("jobs_failed_permanently", queue=lease.queue)
            logger.critical(
                "job %s (%s) failed permanently after %d run(s): %s",
                env.id, env.name or env.handler, env.attempts + int(count_run), text.splitlines()[0],
                extra={"job_id": env.id, "last_error": text},
            )
        result.error = text
        return result

    def _reject(self, lease: Lease, exc: JobsError, counter: str) -> WorkerResult:
        text = f"rejected: {type(exc).__name__}: {exc}"
        logger.error("message %s on queue %s %s", lease.token, lease.queue, text)
        self.metrics.increment(counter, queue=lease.queue)
        env = lease.envelope
        result = WorkerResult("rejected", job_id=lease.token, error=text, queue=lease.queue)
        try:
            self.backend.abandon(lease, text, count_run=False)
        except LeaseLost:
            self.metrics.increment("jobs_lease_lost", queue=lease.queue)
            result.status = "lease-lost"
        result.handler = env.handler if env else None
        return result

    def _ack(self, lease: Lease, *, count_run: bool = True) -> None:
        """Ack; inside run(), also lease the next job in the same round trip where that is free."""
        chain = self._chain
        if chain is None or not count_run or not self.backend.pipelines_ack_fetch or not chain[0]():
            return self.backend.ack(lease, count_run=count_run)
        try:
            # The first queue, as process_once would try first: priorities between queues hold.
            self._ready = self.backend.ack_and_fetch(lease, self.queues[0])
        finally:
            if self._ready is None:
                chain[1]()  # nothing was leased ahead: return its --max ticket

    def _release_ready(self) -> None:
        """A job leased ahead but not started goes straight back, not counted as a run."""
        lease, self._ready = self._ready, None
        if lease is None or lease.envelope is None:
            return
        try:
            self.backend.nack(lease, 0, count_run=False)
        except Exception:  # noqa: BLE001 - it stays leased and the reaper returns it
            logger.warning("job %s: could not hand back the job leased ahead", lease.token, exc_info=True)

    def _requeue_unrun(self, lease: Lease, env: Envelope) -> WorkerResult:
        """Another delivery holds this job's key or lock: try again later, not counted as a run."""
        return self._settle(lease, env, "requeued", self.backend.nack, self.busy_delay, count_run=False)

    def _settle(self, lease: Lease, env: Envelope, status: str, action: Callable[..., None], *args: Any, count_run: bool = True, **kwargs: Any) -> WorkerResult:
        attempt = env.attempts + 1 if count_run else env.attempts
        result = WorkerResult(status, job_id=env.id, attempt=attempt, queue=lease.queue, handler=env.handler)
        try:
            _with_retries(self.backend, action, lease, *args, count_run=count_run, **kwargs)
        except LeaseLost:
            self.metrics.increment("jobs_lease_lost", queue=lease.queue)
            logger.warning("job %s: lease lost before it could be settled as %s", env.id, status)
            result.status = "lease-lost"
        return result

    def _hard_timeout(self, lease: Lease) -> None:
        """Heartbeat thread: the job ignored its soft timeout. Settle it, then end the process."""
        env = lease.envelope
        assert env is not None
        exc = JobTimeout(f"attempt exceeded its timeout by {HARD_TIMEOUT_GRACE:g}s and was killed")
        logger.critical("job %s is stuck past its timeout; settling it as failed", env.id)
        self.metrics.increment("jobs_failed", queue=lease.queue)
        self._fail(lease, env, None, exc)
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
        budget: Any = None,
        on_result: Callable[[WorkerResult], None] | None = None,
        reap: bool = True,
    ) -> int:
        """Process jobs until stopped, out of jobs (``once``), ``max_jobs`` or ``max_time``.

        ``budget`` is shared by the processes of a pool (``take()``/``give_back()``).
        Returns the number of deliveries processed.
        """
        sleep = conf.get("POLL_INTERVAL") if sleep is None else sleep
        deadline = time.monotonic() + max_time if max_time else None
        reaper = Reaper(self.backend, self.queues, metrics=self.metrics) if reap else None
        next_reap = time.monotonic()
        done = failures = 0

        def may_lease_next() -> bool:
            if once or self.stopping or (deadline and time.monotonic() >= deadline):
                return False
            if max_jobs is not None and done + 1 >= max_jobs:  # the job being acked is done + 1
                return False
            return budget is None or budget.take()

        def unused_ticket() -> None:
            if budget is not None:
                budget.give_back()

        self._chain = (may_lease_next, unused_ticket)
        self.heartbeat.start()
        try:
            while not self.stopping and not (deadline and time.monotonic() >= deadline):
                if max_jobs is not None and done >= max_jobs:
                    break
                # A job leased ahead already holds its ticket.
                if self._ready is None and budget is not None and not budget.take():
                    break
                try:
                    if reaper and time.monotonic() >= next_reap:
                        reaper.reap_once()
                        next_reap = time.monotonic() + self.lease_seconds
                    result = self.process_once()
                    failures = 0
                except Exception:
                    # The backend is unreachable: keep the worker alive and back off.
                    failures += 1
                    pause = min(2 ** (failures - 1), 30)
                    logger.exception("worker: backend error; retrying in %ss", pause)
                    self.backend.close()
                    if budget is not None:
                        budget.give_back()
                    self._sleep(pause, deadline)
                    continue
                if result.status == "empty":
                    if budget is not None:
                        budget.give_back()
                    if once:
                        break
                    self._idle(sleep, deadline)
                    continue
                done += 1
                if on_result is not None:
                    on_result(result)
                if once:
                    break
        finally:
            self._chain = None
            if self._ready is not None:
                self._release_ready()
                unused_ticket()
            self.heartbeat.stop()
        return done

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


def _since(moment: datetime) -> float:
    return max((timezone.now() - moment).total_seconds(), 0.0)


def _with_retries(backend: QueueBackend, action: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Settle, retrying a transient backend error a few times within the lease."""
    for pause in (0.2, 1.0, 3.0):
        try:
            return action(*args, **kwargs)
        except LeaseLost:
            raise
        except Exception:
            logger.warning("settle failed; retrying in %ss", pause, exc_info=True)
            backend.close()
            time.sleep(pause)
    return action(*args, **kwargs)
