"""Failed-job and result records for backends whose own storage is not the ``Job`` table.

Every permanent failure, whatever the backend, also shows in the admin as a failed ``Job``
row, from which "retry" re-dispatches it to the backend it came from. A job that keeps its
result (``keep_result``) gets a completed row holding it.

A message that fails verification (a forgery, or a signed message replayed onto another
backend) never changes an existing row: it is kept under a new id of its own, with the id it
claimed in ``last_error``, and the admin's retry refuses it (its signature does not verify).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connections, router
from django.db.models import Q
from django.utils import timezone

from . import signing
from .envelope import Envelope, new_id, storable
from .exceptions import BadSignature, InvalidPayload
from .ids import time_of
from .models import Job, JobStatus, envelope_columns

logger = logging.getLogger("django_jobs.audit")


class Recorded(NamedTuple):
    """A row a record wrote: its id, its ``updated_at``, and whether it was new."""

    pk: str
    updated_at: datetime
    created: bool


def record_failure(
    envelope: Envelope, error: str, backend: str, attempts: int, queue: str | None = None
) -> Recorded | None:
    """Keep a failed ``Job`` copy of ``envelope``, delivered on ``queue`` (default: the queue it
    names); the row written, or ``None``. Never raises: the backend already settled it.

    A broker's worker touches the database only here, so a connection broken by a database
    restart would fail every later record: a failed write closes it and tries once more on a
    fresh one (outside a transaction)."""
    return _keep(envelope, backend, attempts, queue, {"status": JobStatus.FAILED, "last_error": error}, "failure")


def record_cancelled(envelope: Envelope, reason: str, backend: str, attempts: int, queue: str | None = None) -> None:
    """Keep a cancelled ``Job`` copy of ``envelope`` (an aborted job a broker no longer holds),
    with ``reason`` as its last error. Never raises, like :func:`record_failure`."""
    _keep(envelope, backend, attempts, queue, {"status": JobStatus.CANCELLED, "last_error": reason}, "cancellation")


def record_result(envelope: Envelope, value: Any, backend: str, attempts: int, queue: str | None = None) -> None:
    """Keep a completed ``Job`` copy of ``envelope`` holding ``value``, what its run returned.
    Never raises, like :func:`record_failure`."""
    _keep(envelope, backend, attempts, queue, {"status": JobStatus.COMPLETED, "result": value}, "result")


def forget(records: Sequence[Recorded]) -> None:
    """Delete rows a record wrote, unless written again since (never raises): a broker's
    failed job retried or purged while its row was being written."""
    stale = Q()
    for record in records:
        stale |= Q(pk=record.pk, updated_at=record.updated_at)
    try:
        Job.objects.filter(stale).delete()
    except Exception:
        logger.exception("could not delete the failed rows of %d job(s) retried or purged meanwhile", len(records))


def _keep(
    envelope: Envelope, backend: str, attempts: int, queue: str | None, outcome: dict[str, Any], what: str
) -> Recorded | None:
    for last_try in (False, True):
        try:
            return _record(envelope, outcome, backend, attempts, queue)
        except Exception:
            connection = connections[router.db_for_write(Job)]
            if last_try or connection.in_atomic_block:
                logger.exception("could not record the %s of job %r (%s) for the admin", what, envelope.id, backend)
                break
            with contextlib.suppress(Exception):  # it is broken: closing may fail too
                connection.close()
    return None


def _record(envelope: Envelope, outcome: dict[str, Any], backend: str, attempts: int, queue: str | None) -> Recorded:
    now = timezone.now()
    error = outcome.get("last_error", "")
    fields: dict[str, Any] = {
        **envelope_columns(envelope),
        **outcome,
        "attempts": attempts,
        "finished_at": now,
        "updated_at": now,
        "backend": backend,
        "owner_token": None,
        "leased_until": None,
    }
    reason = _untrusted(envelope, backend, queue or envelope.queue)
    if reason is None:
        # A new row's created_at is the job's dispatch, which its id tells, not this record's time.
        fields = _fitted(fields)  # a message from before dispatch refused what no row holds
        sent = {"created_at": time_of(envelope.id) or now}
        _, created = Job.objects.update_or_create(id=envelope.id, defaults=fields, create_defaults={**fields, **sent})
        return Recorded(envelope.id, now, created)
    # Its own record: the fields are the message's as received, for audit, and the id it
    # claimed is only quoted. The signature was made (if at all) over another id, so this
    # row never verifies, and the admin's retry refuses it.
    fields["last_error"] = (
        f"{error}\n\nNot the record of job {envelope.id!r}: {reason}. This is the message as "
        f"received, kept under a new id for audit; it cannot be retried."
    )
    row = Job.objects.create(id=new_id(), created_at=now, **_fitted(fields))
    logger.warning(
        "an unverified message claiming job id %r (%s) was recorded as a new failed row: %s",
        envelope.id,
        backend,
        reason,
    )
    return Recorded(row.pk, now, True)


# What the Job table's integer columns hold on every database.
_INT_RANGE = (-(2**31), 2**31 - 1)


def _fitted(fields: dict[str, Any]) -> dict[str, Any]:
    """Fields as their columns hold them, so a record is kept whatever the message carried:
    text cut to its column's length, with what no backend can store replaced
    (:func:`~django_jobs.envelope.storable`), integers clamped to their column's range."""
    fitted = dict(fields)
    for name, value in fields.items():
        field = Job._meta.get_field(name)
        if isinstance(value, str):
            value = storable(value)
            limit = getattr(field, "max_length", None)
            fitted[name] = value[:limit] if limit else value
        elif (
            isinstance(value, int)
            and not isinstance(value, bool)
            and field.get_internal_type().endswith("IntegerField")
        ):
            low = 0 if field.get_internal_type().startswith("Positive") else _INT_RANGE[0]
            fitted[name] = min(max(value, low), _INT_RANGE[1])
    return fitted


def _untrusted(envelope: Envelope, backend: str, queue: str) -> str | None:
    """Why ``envelope`` may not write the row of the id it names, or ``None`` when it may.

    It may when its signature verifies and that row, if any, is this backend's own record: a
    database backend's job is never overwritten by a copy of it that turned up in a broker.
    """
    try:
        signing.verify_delivery(envelope, queue)  # a genuine message replayed onto another queue fails
    except (BadSignature, InvalidPayload) as exc:
        return f"the message failed verification ({type(exc).__name__})"
    owner = Job.objects.filter(pk=envelope.id).values_list("backend", flat=True).first()
    if owner is not None and owner != backend:
        return f"a job with that id already belongs to backend {owner!r}"
    return None
