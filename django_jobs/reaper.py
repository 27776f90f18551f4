"""Lease recovery: jobs whose worker crashed or stalled go back to their queue."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .backends import get_backend
from .backends.base import QueueBackend
from .metrics import MetricsCollector, get_collector

logger = logging.getLogger("django_jobs.reaper")


class Reaper:
    """Calls ``reap_expired`` for each queue (every queue when ``queues`` is empty)."""

    def __init__(
        self,
        backend: QueueBackend | str | None = None,
        queues: list[str] | None = None,
        *,
        metrics: MetricsCollector | None = None,
    ) -> None:
        self.backend = backend if isinstance(backend, QueueBackend) else get_backend(backend)
        self.queues = list(queues or [])
        self.metrics = metrics or get_collector()

    def reap_once(self) -> int:
        """Recover every expired lease now; return how many were recovered."""
        total = 0
        targets: list[str | None] = list(self.queues) or [None]
        for queue in targets:
            count = self.backend.reap_expired(queue)
            if count:
                self.metrics.increment("jobs_reaped", count, queue=queue or "*")
                logger.warning("reaped %d expired lease(s) on %s", count, queue or "every queue")
            total += count
        return total

    def run(self, interval: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Reap every ``interval`` seconds until ``should_stop()``."""
        while not should_stop():
            try:
                self.reap_once()
            except Exception:
                logger.exception("reaper: backend error")
                self.backend.close()
            end = time.monotonic() + interval
            while not should_stop() and time.monotonic() < end:
                time.sleep(max(min(0.1, end - time.monotonic()), 0))
