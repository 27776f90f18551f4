"""Opt-in helper: copy a message onto ``JOBS["DEAD_LETTER_QUEUE"]``.

Permanent failures already settle through each backend's own mechanism and a failed ``Job``
row; this helper is for code that wants a dead-letter *queue* it can consume.
"""

from __future__ import annotations

import logging
from typing import Any

from . import conf
from .api import Jobs
from .metrics import get_collector

logger = logging.getLogger("django_jobs.dead_letter")


class DeadLetterQueue:
    def __init__(self, backend: str | None = None) -> None:
        self.backend = backend

    def store(self, payload: Any, handler: str, reason: str, attempts: int) -> bool:
        """Enqueue ``payload`` for ``handler`` on the dead-letter queue; ``False`` if that fails."""
        queue = conf.get("DEAD_LETTER_QUEUE")
        if not queue:
            get_collector().increment("jobs_dlq_failed", queue="")
            logger.warning("dead-letter store skipped: JOBS['DEAD_LETTER_QUEUE'] is not set")
            return False
        try:
            (
                Jobs.define(handler, payload)
                .queue(queue)
                .named(f"dead letter after {attempts} attempt(s): {reason}"[:255])
                .dispatch(backend=self.backend)
            )
        except Exception:
            get_collector().increment("jobs_dlq_failed", queue=queue)
            logger.exception("dead-letter store to %r failed", queue)
            return False
        return True
