"""The heartbeat: one background thread per worker that keeps the current lease alive,
enforces the hard time limit of the running attempt, and passes on an abort asked of it
(read with each beat, and about once a second between beats).

It must outlive every fault of the backend, for the life of the process:

- A beat that fails (the server restarted, failed over, or killed our connection) drops this
  thread's connections and tries again at once on a fresh one, then at random moments a
  quarter of a second or less apart (:func:`retry_soon`), so the lease survives as long as the
  backend answers for a moment in each lease timeout.
- The hard time limit fires whatever the backend's health: settling the timed-out attempt is
  tried once, for a bounded time, and the process is ended either way (the supervisor starts a
  fresh one). A settle that could not be made is left to the reaper.
- A failed read of the abort flag between beats is logged at debug level and drops this
  thread's connections; it never affects the lease (the next beat reads the flag too).
- Nothing a beat or a settle raises ends the thread.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .backends.base import Lease, QueueBackend
from .exceptions import LeaseLost, summary
from .logfields import debug_traceback, lease_fields, log_fields

logger = logging.getLogger("django_jobs.worker")

# After a failed write that keeps a lease alive, the next try comes within this (at random).
RETRY_SOON = 0.25
# How long the hard time limit waits for its settle before it ends the process anyway.
SETTLE_BEFORE_KILL = 5.0
# Between beats, the watched job's abort flag is read this often, from this long after its
# start (a shorter job is never asked); not at all when beats come as often.
ABORT_CHECK = 1.0


def retry_soon(lease_seconds: float) -> float:
    """How long to wait before trying again a write that keeps a lease alive (a beat, a batch's
    acks, a settle kept through an outage) after a backend error: a random 40 to 100 % of a
    quarter of a second (of a tenth of the lease timeout, if shorter). Tries at a fixed pace can
    all fall into the down part of an outage that flaps (down most of each second); tries this
    close together, at random moments, get through in its up moments."""
    return random.uniform(0.4, 1.0) * min(RETRY_SOON, lease_seconds / 10)


class Heartbeat:
    """Extends the watched lease every third of the lease timeout, from the moment a delivery
    is trusted until it is settled; runs the watched delivery's keep-alive callbacks (its
    idempotency key and single-instance lock) on every beat; between beats, reads the watched
    job's abort flag every :data:`ABORT_CHECK` seconds (``backend.abort_requested``).

    Watching costs the hot path a few attribute writes under a lock; the thread is long-lived.
    """

    def __init__(
        self,
        backend: QueueBackend,
        lease_seconds: float,
        on_hard_timeout: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.lease_seconds = lease_seconds
        self.interval = max(lease_seconds / 3, 0.05)
        # Runs after a hard time limit was settled (or gave up): the worker ends its process.
        self.on_hard_timeout = on_hard_timeout
        # Runs when a beat could not reach the backend (the worker's reaper then holds off).
        self.on_backend_error: Callable[[], None] | None = None
        # The condition's own lock, taken directly where nothing is notified (the per-job
        # writes): the same exclusion without the condition's Python-level enter and exit.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._lease: Lease | None = None
        self._keep_alive: Sequence[Callable[[], None]] = ()
        self._on_abort: Callable[[str], None] | None = None
        self._next_beat = self._next_check = 0.0
        self._lost: Lease | None = None
        self._failing = False  # the last beat failed: the next failure is logged at debug level
        self._settling = False  # the watched lease's settle is under way
        self._deadline: float | None = None
        self._on_deadline: Callable[[], None] | None = None
        self._timer: tuple[float, Callable[[], None]] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- called by the worker's main thread --

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="django-jobs-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def watch(
        self,
        lease: Lease,
        keep_alive: Sequence[Callable[[], None]] = (),
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        """Keep ``lease`` alive until :meth:`clear`; ``keep_alive`` callables run on every beat.
        ``on_abort`` is called once, on this thread, with who asked, when a beat or a check
        between beats finds that the job was asked to abort."""
        now = time.monotonic()
        with self._lock:
            self._lease, self._keep_alive, self._on_abort = lease, keep_alive, on_abort
            self._next_beat, self._next_check = now + self.interval, now + ABORT_CHECK
            self._settling = False

    def settling(self) -> None:
        """The watched run is over and its settle under way: it is still beaten (the settle may
        take its retries), but a beat that finds the lease gone may have come after the settle
        itself, whose answer is on its way. The settle says whether the lease was lost."""
        self._settling = True

    def arm(self, deadline: float, on_deadline: Callable[[], None], *, earliest: bool = False) -> None:
        """Hard time limit of the running attempt: at ``deadline`` (a ``time.monotonic()``
        value) settle it with ``on_deadline``, then call ``on_hard_timeout``. ``earliest``: only
        if no earlier deadline is armed."""
        with self._cond:
            if earliest and self._deadline is not None and self._deadline <= deadline:
                return
            self._deadline, self._on_deadline = deadline, on_deadline
            self._cond.notify()

    def disarm(self) -> None:
        with self._lock:
            self._deadline = self._on_deadline = None

    def after(self, moment: float, action: Callable[[], None]) -> None:
        """Run ``action`` on this thread at ``moment`` (a ``time.monotonic()`` value), unless
        :meth:`cancel` or another ``after`` comes first: one timer at a time."""
        with self._cond:
            self._timer = (moment, action)
            self._cond.notify()

    def cancel(self) -> None:
        with self._cond:
            self._timer = None

    def clear(self, lease: Lease) -> None:
        """The delivery of ``lease`` is over: stop beating it."""
        with self._lock:
            if self._lease is lease:
                self._lease, self._keep_alive, self._on_abort = None, (), None
                self._deadline = self._on_deadline = None

    def lost(self, lease: Lease) -> bool:
        """Did a beat find that ``lease`` is no longer ours (it was reaped)?"""
        return self._lost is lease

    # -- the thread --

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    break
                action = self._due()
                if action is None:
                    continue
            try:
                action()
            except BaseException:
                logger.exception("heartbeat: unexpected error; carrying on")
        # This thread's connections end with it: a pooled one goes back to its pool, where it
        # would otherwise stay taken for the life of the process.
        self._reset_connections()

    def _due(self) -> Callable[[], None] | None:
        """Under the lock: what is due now, or wait until something may be."""
        lease, now, timer = self._lease, time.monotonic(), self._timer
        if timer is not None and now >= timer[0]:
            self._timer = None
            return timer[1]
        if lease is None:
            # Poll rather than be notified: watch() then costs the hot path no thread wake-up,
            # and a new lease is still beaten within one interval of its start, and its abort
            # flag read a second after it.
            idle = min(self.interval, ABORT_CHECK)
            self._cond.wait(idle if timer is None else min(idle, timer[0] - now))
            return None
        if self._deadline is not None and now >= self._deadline:
            on_deadline = self._on_deadline
            self._lease, self._keep_alive = None, ()
            self._deadline = self._on_deadline = None
            return lambda: self._hard_timeout(on_deadline, lease)
        if now >= self._next_beat:
            keep_alive = self._keep_alive
            # A beat reads the abort flag too: the next check is a second after it.
            self._next_beat, self._next_check = now + self.interval, now + ABORT_CHECK
            return lambda: self._beat(lease, keep_alive)
        checking = self._on_abort is not None  # until an abort was passed on
        if checking and now >= self._next_check:
            self._next_check = now + ABORT_CHECK
            return lambda: self._check(lease)
        wake = min(self._next_beat, self._next_check) if checking else self._next_beat
        if self._deadline is not None:
            wake = min(wake, self._deadline)
        if timer is not None:
            wake = min(wake, timer[0])
        self._cond.wait(wake - now)
        return None

    def _beat(self, lease: Lease, keep_alive: Sequence[Callable[[], None]]) -> None:
        if not self._extend(lease):
            return
        for keep in keep_alive:
            try:
                keep()
            except Exception:
                logger.warning(
                    "job %s: could not renew its idempotency key or lock",
                    lease.token,
                    exc_info=True,
                    extra=lease_fields(lease),
                )
                self._reset_connections()

    def _check(self, lease: Lease) -> None:
        """Between beats: has the watched job been asked to abort? A failed read is quiet and
        leaves the lease alone; this thread's connections are dropped, the next beat reconnects."""
        try:
            requested_by = self.backend.abort_requested(lease)
        except Exception:
            logger.debug("job %s: could not read its abort flag", lease.token, exc_info=True, extra=lease_fields(lease))
            self._reset_connections()
            return
        if requested_by:
            self._aborted(lease, requested_by)

    def _aborted(self, lease: Lease, requested_by: str) -> None:
        """The watched job was asked to abort: tell its ``on_abort``, once."""
        with self._cond:
            if self._lease is not lease:
                return
            on_abort, self._on_abort = self._on_abort, None
        if on_abort is not None:
            on_abort(requested_by)

    def _extend(self, lease: Lease) -> bool:
        """One beat: extend, and on a backend error retry once at once on fresh connections,
        then again soon (:func:`retry_soon`; logged once a run of failures). An extend that
        finds the job asked to abort passes that on."""
        for last_try in (False, True):
            try:
                aborted_by = self.backend.extend(lease, self.lease_seconds)
            except LeaseLost:
                with self._cond:
                    if self._lease is lease and not self._settling:  # not a late beat of a job settled
                        logger.warning(
                            "job %s: lease lost while running (reaped after a stall?)",
                            lease.token,
                            extra=lease_fields(lease, outcome="lost"),
                        )
                        self._lost = lease
                    if self._lease is lease:
                        self._lease = None
                return False
            except Exception as exc:  # noqa: BLE001 - logged by _failed_beat: any error of the backend's client
                self._reset_connections()
                if last_try:
                    self._failed_beat(lease, exc)
                continue
            self._failing = False
            if aborted_by:
                self._aborted(lease, aborted_by)
            return True
        return False

    def _failed_beat(self, lease: Lease, error: Exception) -> None:
        """Tried again soon; only the first failure of a run is a warning (the rest: DEBUG)."""
        if self.on_backend_error is not None:
            self.on_backend_error()
        pause = retry_soon(self.lease_seconds)
        logger.log(
            logging.DEBUG if self._failing else logging.WARNING,
            "job %s: heartbeat failed (%s); retrying in %.2fs",
            lease.token,
            summary(error),
            pause,
            exc_info=debug_traceback(logger, error),
            extra=lease_fields(lease),
        )
        self._failing = True
        with self._cond:
            if self._lease is lease:
                self._next_beat = time.monotonic() + pause

    def _reset_connections(self) -> None:
        """Drop this thread's connections; the main thread keeps its own."""
        try:
            self.backend.reset_connection()
        except Exception:  # closing a dead connection may raise; it is gone either way
            logger.debug("heartbeat: closing a broken connection failed", exc_info=True)

    def _hard_timeout(self, on_deadline: Callable[[], None] | None, lease: Lease | None = None) -> None:
        """Settling can wait, killing cannot: the settle gets a bounded time in a thread of its
        own (it may hang on an unreachable backend), then the process ends either way. Its
        records carry the log fields of ``lease``, the timed-out one."""
        extra = log_fields(None, None) if lease is None else lease_fields(lease)
        if on_deadline is not None:
            settler = threading.Thread(target=self._settle_quietly, args=(on_deadline, extra), daemon=True)
            settler.start()
            settler.join(SETTLE_BEFORE_KILL)
            if settler.is_alive():
                logger.error(
                    "hard timeout: the backend did not answer in %gs; the reaper will settle the job",
                    SETTLE_BEFORE_KILL,
                    extra=extra,
                )
        if self.on_hard_timeout is not None:
            self.on_hard_timeout()

    def _settle_quietly(self, settle: Callable[[], None], extra: dict[str, Any]) -> None:
        try:
            settle()
        except Exception:
            logger.exception("hard timeout: could not settle the job; the reaper will", extra=extra)
        finally:
            self._reset_connections()  # this short-lived thread's own connections
