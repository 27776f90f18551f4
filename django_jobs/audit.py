"""Failed-job records for backends whose own storage is not the ``Job`` table.

SPEC 7: every permanent failure, whatever the backend, also shows in the admin as a failed
``Job`` row, from which "retry" re-dispatches it to the backend it came from.
"""

from __future__ import annotations

import logging

from django.utils import timezone

from .envelope import Envelope
from .models import Job, JobStatus

logger = logging.getLogger("django_jobs.audit")


def record_failure(envelope: Envelope, error: str, backend: str, attempts: int) -> None:
    """Keep a failed ``Job`` copy of ``envelope``. Never raises: the backend already settled it."""
    now = timezone.now()
    try:
        Job.objects.update_or_create(
            id=envelope.id,
            defaults={
                "queue": envelope.queue, "handler": envelope.handler, "payload": envelope.payload,
                "options": envelope.options, "signature": envelope.signature, "name": envelope.name,
                "status": JobStatus.FAILED, "attempts": attempts, "max_retries": envelope.max_retries,
                "priority": envelope.priority, "timeout": envelope.timeout,
                "idempotency_key": envelope.idempotency_key, "last_error": error, "finished_at": now,
                "updated_at": now, "backend": backend, "owner_token": None, "leased_until": None,
            },
        )
    except Exception:
        logger.exception("could not record the failure of job %s (%s) for the admin", envelope.id, backend)
