"""What the admin and the maintenance commands do, kept out of both so each stays thin."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import router, transaction
from django.db.models import QuerySet
from django.utils import timezone

from . import conf, dependencies, history, rows, signing
from .backends import get_backend
from .backends.base import AbortAsked
from .backends.database import DatabaseBackend
from .exceptions import AbortNotSupported, BadSignature, InvalidPayload, JobAborted
from .heartbeat import ABORT_CHECK
from .models import FINISHED_STATUSES, AttemptOutcome, Dependency, Job, JobAttempt, JobStatus, envelope_of

logger = logging.getLogger("django_jobs.operations")
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> timedelta:
    """``"90"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> a timedelta.

    Raises ``ValueError`` for text it cannot read and for an age reaching back before year 1
    (``99999999999d``), which no date arithmetic could use.
    """
    match = _AGE.match(text)
    if not match:
        raise ValueError(f"cannot read age {text!r}; use e.g. 3600, 15m, 12h, 7d or 2w")
    try:
        age = timedelta(seconds=float(match[1]) * _UNITS[match[2]])
        timezone.now() - age  # what a caller computes with it: must stay a valid date
    except OverflowError:
        shown = text if len(text) <= 30 else text[:27] + "..."
        raise ValueError(f"age {shown!r} is too large: it reaches back before year 1") from None
    return age


def job_aliases() -> list[str]:
    """Every database holding ``Job`` rows: the router's (audit copies) and each database backend's."""
    aliases = [router.db_for_write(Job)]
    for name in conf.get("BACKENDS") or {}:
        try:
            backend = get_backend(name)
        except ImproperlyConfigured:
            continue  # reported by the system checks
        if isinstance(backend, DatabaseBackend) and backend.alias not in aliases:
            aliases.append(backend.alias)
    return aliases


def purge(status: str, queue: str | None = None, before: timedelta | None = None, dry_run: bool = False) -> int:
    """Delete finished jobs (``completed``, ``failed`` or ``cancelled``), optionally older than ``before``."""
    # JobStatus members are str; without Django's stubs mypy sees their (value, label) tuples.
    if status not in FINISHED_STATUSES:  # type: ignore[comparison-overlap]
        raise ValueError("only completed or failed jobs (and cancelled ones) can be purged")
    total = 0
    for alias in job_aliases():
        jobs = Job.objects.using(alias).filter(status=status)
        if queue:
            jobs = jobs.filter(queue=queue)
        if before is not None:
            jobs = jobs.filter(finished_at__lt=timezone.now() - before)
        if dry_run:
            total += jobs.count()
            continue
        JobAttempt.objects.using(alias).filter(job__in=jobs.values("pk")).delete()
        # A finished job's own edges (to its parents) are of no use any more.
        Dependency.objects.using(alias).filter(child__in=jobs.values("pk")).delete()
        total += jobs.delete()[0]
        if status == JobStatus.COMPLETED:  # type: ignore[comparison-overlap]
            # The history of broker jobs that failed and then completed: they have no row.
            orphans = JobAttempt.objects.using(alias).exclude(job__in=Job.objects.using(alias).values("pk"))
            if before is not None:
                orphans = orphans.filter(finished_at__lt=timezone.now() - before)
            orphans.delete()
    if status == JobStatus.FAILED and not dry_run:  # type: ignore[comparison-overlap]
        # Brokers keep their own failed set too (the Job rows above are their audit copies).
        for name in conf.get("BACKENDS") or {}:
            for q in [queue] if queue else conf.queues():
                try:
                    get_backend(name).purge_failed(q, before)
                except Exception:  # the Job rows are gone already; say which broker kept its copies
                    logger.exception("jobs_purge: could not purge failed messages of %s/%s", name, q)
    return total


@dataclass
class RetryOutcome:
    retried: int = 0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # worth telling, not a failure
    # The rows retried, as they were before the retry (failed or cancelled, their runs and last error).
    jobs: list[Job] = field(default_factory=list)
    # Of the ids asked for: those no database holds, and those neither failed nor cancelled (id -> status).
    unknown: list[str] = field(default_factory=list)
    not_retryable: dict[str, str] = field(default_factory=dict)


# What a retry gives a fresh start: jobs that failed for good, and jobs an operator cancelled.
RETRYABLE: tuple[str, ...] = (str(JobStatus.FAILED), str(JobStatus.CANCELLED))


def retry_by_id(ids: list[str] | None, queue: str | None = None) -> RetryOutcome:
    """``jobs_retry``: the failed or cancelled jobs with these ids (every failed job when
    ``None``), in every database; the ids are looked up a chunk at a time."""
    outcome = RetryOutcome()
    wanted = list(dict.fromkeys(ids)) if ids is not None else None
    for alias in job_aliases():
        jobs = Job.objects.using(alias).all()
        if queue:
            jobs = jobs.filter(queue=queue)
        chosen = [jobs.filter(status=JobStatus.FAILED)] if wanted is None else _by_ids(jobs, wanted)
        for some in chosen:
            more = retry_jobs(some)
            outcome.retried += more.retried
            outcome.jobs += more.jobs
            outcome.errors += more.errors
            outcome.notes += [note for note in more.notes if note not in outcome.notes]
    if wanted is not None:
        retried = {job.pk for job in outcome.jobs}
        found: dict[str, str] = {}
        for alias in job_aliases():
            for some in _by_ids(Job.objects.using(alias).all(), wanted):
                found.update((str(pk), str(status)) for pk, status in some.values_list("pk", "status"))
        found = {pk: status for pk, status in found.items() if pk not in retried}
        outcome.unknown = [i for i in wanted if i not in found and i not in retried]
        outcome.not_retryable = {i: status for i, status in found.items() if status not in RETRYABLE}
    return outcome


def _by_ids(jobs: QuerySet[Job], ids: list[str]) -> list[QuerySet[Job]]:
    """``jobs`` with these ids, one query set per chunk of them (no statement lists them all)."""
    return [jobs.filter(pk__in=chunk) for chunk in rows.chunked(ids)]


def retry_jobs(jobs: QuerySet[Job]) -> RetryOutcome:
    """Give failed and cancelled jobs a fresh start: pending, attempts 0, available now.

    A database-backend row is reset in place; an audit copy of a job that failed on another
    backend is re-dispatched to that backend (``redispatch``) and the copy removed (a new failure
    re-records it). Either way a job with parents runs without them: they are not consulted again.
    A job whose backend is no longer configured stays failed and is reported in ``errors``, and
    so does a row whose signature does not verify (a forged or tampered message kept for audit):
    a retry never re-signs or re-sends what no key holder dispatched. ``jobs`` of the outcome
    holds the rows retried as they were read (their status, runs and last error).
    """
    now = timezone.now()
    outcome = RetryOutcome()
    for row in jobs.filter(status__in=RETRYABLE):
        try:
            signing.verify_delivery(envelope_of(row), row.queue)
        except (BadSignature, InvalidPayload) as exc:
            outcome.errors.append(f"job {row.pk} was not retried: its signature does not verify ({exc})")
            continue
        try:
            backend = get_backend(row.backend)
        except ImproperlyConfigured as exc:
            outcome.errors.append(f"job {row.pk} was not retried: {exc}")
            continue
        # The next round's attempts are numbered from 1 again: bound the history kept from before.
        history.trim(row.pk, using=row._state.db)
        if isinstance(backend, DatabaseBackend):
            reset = (
                Job.objects.using(backend.alias)
                .filter(pk=row.pk, status=row.status)
                .update(
                    status=JobStatus.PENDING,
                    attempts=0,
                    available_at=now,
                    owner_token=None,
                    leased_until=None,
                    finished_at=None,
                    last_error="",
                    abort_requested=None,
                    abort_requested_at=None,
                    updated_at=now,
                )
            )
            if not reset:
                continue  # retried meanwhile
        else:
            backend.redispatch(envelope_of(row))
            # Enqueued first, so a failed push loses nothing; a backend that ran it inline and
            # recorded a new failure (sync) has changed updated_at, and that record stays.
            Job.objects.using(row._state.db).filter(pk=row.pk, updated_at=row.updated_at).delete()
            if backend.native_dead_letter:
                note = (
                    f"backend {backend.name!r} keeps its own dead-lettered copy of each retried job "
                    "until `jobs_purge --status failed` removes it"
                )
                if note not in outcome.notes:
                    outcome.notes.append(note)
        outcome.retried += 1
        outcome.jobs.append(row)
    return outcome


@dataclass
class CancelOutcome:
    # The rows cancelled, as they were before (pending or waiting, their runs so far).
    jobs: list[Job] = field(default_factory=list)


# Jobs that have not started: cancelled at once.
NOT_STARTED: tuple[str, ...] = (str(JobStatus.PENDING), str(JobStatus.WAITING))


def cancel_jobs(jobs: QuerySet[Job], reason: str, worker: str | None = None) -> CancelOutcome:
    """Stop the pending (or waiting) jobs among ``jobs`` before they run: each becomes
    ``cancelled``, finished now, with ``reason`` as its last error, and its attempt history
    records a ``cancelled`` attempt (by ``worker``, e.g. ``admin:boss``; this process's
    ``host:pid`` by default) in place of the run it will not have. The jobs waiting for it are
    decided in the same transaction (cancelled too, unless ``run_if_parent_fails``).

    Each row is settled by one UPDATE that matches it only while it has not started, so a job
    a worker claimed meanwhile runs on untouched. Only a database backend's queue has pending
    rows: a job queued on a broker has no row until it fails, and cannot be cancelled here.
    ``retry_jobs`` runs a cancelled job again.
    """
    outcome = CancelOutcome()
    for row in jobs.filter(status__in=NOT_STARTED):
        db = row._state.db
        now = timezone.now()
        with transaction.atomic(using=db):
            cancelled = (
                Job.objects.using(db)
                .filter(pk=row.pk, status=row.status)
                .update(
                    status=JobStatus.CANCELLED,
                    finished_at=now,
                    last_error=reason,
                    owner_token=None,
                    leased_until=None,
                    updated_at=now,
                )
            )
            resolution = dependencies.resolve(db, row.pk, "cancelled") if cancelled else None
        if resolution is None:
            continue  # claimed, released (or cancelled) meanwhile
        history.record(row.pk, row.attempts + 1, AttemptOutcome.CANCELLED, error=reason, worker=worker, using=db)
        dependencies.record(resolution, db)
        outcome.jobs.append(row)
    return outcome


@dataclass
class AbortOutcome:
    """What :func:`abort_jobs` did with each id it was given."""

    cancelled: list[str] = field(default_factory=list)  # pending: cancelled before they ran
    asked: list[str] = field(default_factory=list)  # running: asked to abort, their workers stop them
    # Running, asked to abort before: left as they are (id -> who asked first, and when).
    already: dict[str, AbortAsked] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # already finished (id -> status): left alone
    unknown: list[str] = field(default_factory=list)  # no database or backend holds them
    # Backends that cannot abort a job by its id (an unknown id may be one of theirs).
    unsupported: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # backends that could not be asked

    @property
    def stopped(self) -> int:
        """How many jobs were cancelled or asked to abort."""
        return len(self.cancelled) + len(self.asked)


# The longest ``requested_by`` (the ``Job.abort_requested`` column).
MAX_REQUESTED_BY = 150


def check_requested_by(requested_by: object) -> None:
    """``ValueError`` unless ``requested_by`` names who asks in 1 to :data:`MAX_REQUESTED_BY`
    characters (not only spaces)."""
    if not isinstance(requested_by, str) or not requested_by.strip() or len(requested_by) > MAX_REQUESTED_BY:
        raise ValueError(
            f"requested_by must name who asks to abort in 1 to {MAX_REQUESTED_BY} characters, not {requested_by!r:.60}"
        )


def abort_jobs(ids: list[str], requested_by: str) -> AbortOutcome:
    """Abort the jobs with these ids, wherever they are. ``requested_by`` says who asked
    (``admin:boss``, ``command``, ``api``; see :func:`check_requested_by`); it is recorded with
    the cancelled attempt.

    A pending job is cancelled at once (as :func:`cancel_jobs` does). A running one is flagged,
    with who asked and when: its worker's heartbeat sees the flag within about a second and
    stops the job (within :func:`abort_within` seconds), which then ends ``cancelled``, never
    retried. A running job flagged before is left as it is: the first request stands
    (``already``). A finished job is left alone. A job with no ``Job`` row (queued or running
    on a broker) is looked up in each broker backend (``request_abort``)."""
    check_requested_by(requested_by)
    outcome = AbortOutcome()
    left = dict.fromkeys(ids)
    for alias in job_aliases():
        for some in _by_ids(Job.objects.using(alias).all(), list(left)):
            for pk in some.values_list("pk", flat=True):
                _abort_row(alias, str(pk), requested_by, outcome)
                del left[str(pk)]
    for job_id in left:
        if _abort_queued(job_id, requested_by, outcome) == "unknown":
            outcome.unknown.append(job_id)
    return outcome


def _abort_row(alias: str, pk: str, requested_by: str, outcome: AbortOutcome) -> None:
    """Cancel the row while it is pending, else flag it while it runs (unless it is flagged
    already), else report its status."""
    jobs = Job.objects.using(alias).filter(pk=pk)
    if cancel_jobs(jobs, JobAborted.describe(requested_by), worker=requested_by).jobs:
        outcome.cancelled.append(pk)
        return
    now = timezone.now()
    unflagged = jobs.filter(status=JobStatus.IN_PROGRESS, abort_requested__isnull=True)
    if unflagged.update(abort_requested=requested_by, abort_requested_at=now, updated_at=now):
        outcome.asked.append(pk)
        return
    status, by, at = jobs.values_list("status", "abort_requested", "abort_requested_at").first() or (None, None, None)
    asked = running_abort(status, by, at)
    if asked is not None:
        outcome.already[pk] = asked
    else:
        outcome.finished[pk] = str(status)


def _abort_queued(job_id: str, requested_by: str, outcome: AbortOutcome) -> str:
    """Ask each broker backend to abort ``job_id``: what the first that holds it did, or
    ``"unknown"``."""
    for name in conf.get("BACKENDS") or {}:
        try:
            backend = get_backend(name)
        except ImproperlyConfigured:
            continue  # reported by the system checks
        if isinstance(backend, DatabaseBackend):
            continue  # its jobs are rows, handled above
        try:
            done = backend.request_abort(job_id, requested_by)
        except AbortNotSupported:
            if name not in outcome.unsupported:
                outcome.unsupported.append(name)
            continue
        except Exception as exc:  # noqa: BLE001 - one unreachable broker must not hide the others
            outcome.errors.append(f"job {job_id}: backend {name!r} could not be asked: {type(exc).__name__}: {exc}")
            continue
        if isinstance(done, AbortAsked):
            outcome.already[job_id] = done
            return "already"
        if done == "cancelled":
            outcome.cancelled.append(job_id)
        elif done == "asked":
            outcome.asked.append(job_id)
        if done != "unknown":
            return done
    return "unknown"


def running_abort(status: str | None, by: str | None, at: datetime | None) -> AbortAsked | None:
    """The abort a row's columns say its running job was asked (a finished job keeps who
    asked, and its last error says so: ``None`` then, as for a job nobody asked)."""
    running = status == JobStatus.IN_PROGRESS  # type: ignore[comparison-overlap]
    return AbortAsked(by, at) if running and by is not None else None


def abort_within() -> int:
    """About how many seconds a running job's worker takes to stop it once asked: the check of
    the flag (about a second), then ``ABORT_GRACE`` for a job that does not stop by itself."""
    return math.ceil(ABORT_CHECK + float(conf.get("ABORT_GRACE")))


def utc_text(moment: datetime) -> str:
    """``2026-05-01 14:03:09 UTC``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def requested_text(asked: AbortAsked, shown: Callable[[datetime], str] = utc_text) -> str:
    """``requested by admin:boss at 2026-05-01 14:03:09 UTC`` (``shown`` writes the time; none
    when it was not kept)."""
    return f"requested by {asked.by}" + ("" if asked.at is None else f" at {shown(asked.at)}")


def stats(backend_names: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per backend and queue: pending, delayed, in_progress, failed."""
    rows: list[dict[str, Any]] = []
    for name in backend_names or list(conf.get("BACKENDS")):
        for queue in conf.queues():
            try:
                rows.append({"backend": name, "queue": queue, **get_backend(name).stats(queue)})
            except Exception as exc:  # noqa: BLE001 - one unreachable broker must not hide the others
                rows.append({"backend": name, "queue": queue, "error": f"{type(exc).__name__}: {exc}"})
    return rows


# What ``jobs_list`` shows of a job, in this order (``--json`` adds nothing else).
LISTED = (
    "id", "status", "queue", "backend", "name", "handler", "attempts", "max_retries", "priority",
    "available_at", "created_at", "updated_at", "finished_at", "last_error", "abort_requested",
    "abort_requested_at",
)  # fmt: skip


def list_jobs(
    status: str | None = None, queue: str | None = None, backend: str | None = None, limit: int = 20
) -> list[dict[str, Any]]:
    """The newest ``limit`` jobs of the ``Job`` table (of every database holding it), most
    recently changed first, as dicts of :data:`LISTED`. On a broker backend the table holds the
    failed jobs (and the completed ones that keep a result), not those still queued."""
    rows: list[dict[str, Any]] = []
    for alias in job_aliases():
        jobs = Job.objects.using(alias).all()
        if status:
            jobs = jobs.filter(status=status)
        if queue:
            jobs = jobs.filter(queue=queue)
        if backend:
            jobs = jobs.filter(backend=backend)
        rows += jobs.order_by("-updated_at", "-id").values(*LISTED)[:limit]
    rows.sort(key=lambda row: (row["updated_at"], row["id"]), reverse=True)
    return rows[:limit]
