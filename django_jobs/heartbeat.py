"""One background thread per worker: extends the current lease and enforces hard timeouts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from .backends.base import Lease, QueueBackend
from .exceptions import LeaseLost

logger = logging.getLogger("django_jobs.worker")


class Heartbeat:
    """Extends the watched lease every third of the lease timeout while a job runs.

    Watching costs the hot path two attribute writes under a lock; the thread is long-lived.
    """

    def __init__(
        self,
        backend: QueueBackend,
        lease_seconds: float,
        on_hard_timeout: Callable[[Lease], None],
    ) -> None:
        self.backend = backend
        self.lease_seconds = lease_seconds
        self.interval = max(lease_seconds / 3, 0.05)
        self.on_hard_timeout = on_hard_timeout
        self._cond = threading.Condition()
        self._lease: Lease | None = None
        self._hard_deadline: float | None = None
        self._last_beat = 0.0
        self._keep_alive: Sequence[Callable[[], None]] = ()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
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
        self, lease: Lease, hard_deadline: float | None, keep_alive: Sequence[Callable[[], None]] = ()
    ) -> None:
        """Start heartbeating ``lease``; ``hard_deadline`` is a ``time.monotonic()`` value.

        ``keep_alive`` callables run on every beat too (the job's idempotency key and
        single-instance lock live as long as its lease).
        """
        with self._cond:
            self._lease, self._hard_deadline, self._last_beat = lease, hard_deadline, time.monotonic()
            self._keep_alive = keep_alive
            if hard_deadline is not None:
                self._cond.notify()

    def clear(self) -> None:
        with self._cond:
            self._lease = self._hard_deadline = None

    def _loop(self) -> None:
        with self._cond:
            while not self._stopping:
                lease = self._lease
                if lease is None:
                    # Poll rather than be notified: watch() then costs the hot path no thread
                    # wake-up, and a new lease is still beaten within one interval of its start.
                    self._cond.wait(self.interval)
                    continue
                now = time.monotonic()
                due = self._last_beat + self.interval
                if self._hard_deadline is not None and now >= self._hard_deadline:
                    self._lease = self._hard_deadline = None
                    self._cond.release()
                    try:
                        self.on_hard_timeout(lease)
                    finally:
                        self._cond.acquire()
                    continue
                if now >= due:
                    self._last_beat = now
                    self._cond.release()
                    try:
                        self._beat(lease)
                    finally:
                        self._cond.acquire()
                    continue
                wake = due if self._hard_deadline is None else min(due, self._hard_deadline)
                self._cond.wait(wake - now)

    def _beat(self, lease: Lease) -> None:
        try:
            self.backend.extend(lease, self.lease_seconds)
            for keep in self._keep_alive:
                keep()
        except LeaseLost:
            logger.warning("job %s: lease lost while running (reaped after a stall?)", lease.token)
            with self._cond:
                if self._lease is lease:
                    self._lease = None
        except Exception:  # a broker blip must not kill the heartbeat; try again next beat
            logger.exception("job %s: heartbeat failed", lease.token)
