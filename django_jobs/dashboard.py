"""Figures for the admin dashboard, for every backend: each queue's depth, throughput and
failure rates from the ``Throughput`` table, and the handlers failing most.

Each figure is aggregated in SQL, so the page costs the same number of queries however many
jobs there are: one per database the failed and cancelled rows live in, one per configured
database-backend queue for its depth (brokers are asked over their own connections), and one
each for throughput, the hourly chart and the failing handlers; and a few per rate or
concurrency limit, on each backend that enforces limits. The windows end at ``now``,
which tests pass in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import router
from django.db.models import Count, Max, OuterRef, Q, Subquery, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from . import conf, limits, registry
from .backends import get_backend
from .backends.base import LimitUsage, QueueBackend
from .backends.database import DatabaseBackend
from .models import Job, JobStatus, Throughput

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
HOURS = 24  # columns of the hourly chart
TOP_HANDLERS = 10

# The queue table's columns a Job row can back, and the status each one lists.
COLUMN_STATUS: dict[str, str] = {
    "pending": str(JobStatus.PENDING),
    "delayed": str(JobStatus.PENDING),
    "waiting": str(JobStatus.WAITING),
    "in_progress": str(JobStatus.IN_PROGRESS),
    "failed": str(JobStatus.FAILED),
    "cancelled": str(JobStatus.CANCELLED),
}
# Of those, the ones a broker's Job rows back: a broker keeps its waiting jobs to itself.
AUDIT_COLUMNS = ("failed", "cancelled")
COUNTERS = ("completed", "retried", "failed", "rejected")


@dataclass
class QueueRow:
    """One backend's queue: its depth from the backend, its failed and cancelled ``Job`` rows."""

    backend: str
    queue: str
    pending: int = 0  # ready to run now
    delayed: int = 0
    waiting: int = 0  # held until their parents finish
    in_progress: int = 0
    failed: int = 0  # failed Job rows (a broker's audit copies)
    cancelled: int = 0
    held_failed: int = 0  # failed jobs the backend itself holds (a failed set, buried, dead-lettered)
    ready_age: float | None = None  # seconds the oldest ready job has waited; None: unknown
    error: str = ""  # the backend could not be read
    linked: tuple[str, ...] = ()  # columns the admin's job list can list
    checked_at: datetime = field(default_factory=timezone.now)  # when the depth was read

    def filters(self, column: str) -> dict[str, str]:
        """The job list's lookups listing the jobs counted in ``column`` (one of ``linked``)."""
        lookups = {
            "status__exact": COLUMN_STATUS[column],
            "queue": self.queue,
            "backend": self.backend,
        }
        if column == "pending":
            lookups["available_at__lte"] = self.checked_at.isoformat()
        elif column == "delayed":
            lookups["available_at__gt"] = self.checked_at.isoformat()
        return lookups


def queue_rows() -> list[QueueRow]:
    """One row per configured backend and queue (``JOBS["BACKENDS"]`` × ``JOBS["QUEUES"]``); a
    backend that cannot be read gets rows holding its error, the others are unaffected."""
    counted: dict[str, dict[tuple[str, str, str], int]] = {}  # per database alias
    admin_alias = router.db_for_read(Job)
    rows: list[QueueRow] = []
    for name in conf.get("BACKENDS"):
        try:
            backend = get_backend(name)
            alias = backend.alias if isinstance(backend, DatabaseBackend) else router.db_for_write(Job)
            if alias not in counted:
                counted[alias] = _audit_counts(alias)
        except Exception as exc:  # noqa: BLE001 - one unreachable backend must not break the page
            rows += [QueueRow(name, queue, error=_error(exc)) for queue in conf.queues()]
            continue
        linked: tuple[str, ...] = ()
        if alias == admin_alias:
            linked = tuple(COLUMN_STATUS) if isinstance(backend, DatabaseBackend) else AUDIT_COLUMNS
        rows += [_queue_row(backend, queue, counted[alias], linked) for queue in conf.queues()]
    return rows


def _queue_row(
    backend: QueueBackend, queue: str, counted: dict[tuple[str, str, str], int], linked: tuple[str, ...]
) -> QueueRow:
    row = QueueRow(
        backend.name,
        queue,
        failed=counted.get((backend.name, queue, COLUMN_STATUS["failed"]), 0),
        cancelled=counted.get((backend.name, queue, COLUMN_STATUS["cancelled"]), 0),
        linked=linked,
    )
    try:
        stats = backend.stats(queue)
        row.ready_age = backend.oldest_ready_age(queue)
    except Exception as exc:  # noqa: BLE001 - one unreachable backend must not break the page
        row.error, row.linked = _error(exc), ()
        return row
    row.checked_at = timezone.now()
    row.pending, row.delayed, row.in_progress = stats["pending"], stats["delayed"], stats["in_progress"]
    row.waiting = stats.get("waiting", 0)  # backends without dependencies have none
    row.held_failed = stats["failed"]
    return row


def _audit_counts(alias: str) -> dict[tuple[str, str, str], int]:
    """Failed and cancelled ``Job`` rows of database ``alias`` by (backend, queue, status)."""
    rows = (
        Job.objects.using(alias)
        .order_by()
        .filter(status__in=(JobStatus.FAILED, JobStatus.CANCELLED))
        .values_list("backend", "queue", "status")
        .annotate(n=Count("pk"))
    )
    return {(backend, queue, status): n for backend, queue, status, n in rows}


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Counts:
    """Deliveries that ended each way, summed over worker processes and minutes."""

    completed: int = 0
    retried: int = 0
    failed: int = 0
    rejected: int = 0

    @property
    def failure_rate(self) -> float | None:
        """failed / (completed + failed), or ``None`` when no job finished."""
        finished = self.completed + self.failed
        return self.failed / finished if finished else None


@dataclass(frozen=True)
class ThroughputRow:
    """A backend's counts (or the total, ``backend=""``) over the last hour and the last day."""

    backend: str
    hour: Counts
    day: Counts


def throughput(now: datetime) -> list[ThroughputRow]:
    """Per configured backend (and any other that has counts), then the total: the counts of
    the minutes that started in (now − 1 h, now] and in (now − 1 day, now]."""
    hour = Q(minute__gt=now - HOUR)
    sums = {f"{name}_day": Sum(name) for name in COUNTERS} | {
        f"{name}_hour": Sum(name, filter=hour) for name in COUNTERS
    }
    found = {
        row["backend"]: row
        for row in Throughput.objects.order_by()
        .filter(minute__gt=now - DAY, minute__lte=now)
        .values("backend")
        .annotate(**sums)
    }
    names = list(conf.get("BACKENDS")) + sorted(set(found) - set(conf.get("BACKENDS")))
    rows = [ThroughputRow(name, _counts(found.get(name), "hour"), _counts(found.get(name), "day")) for name in names]
    total = ThroughputRow("", _sum([row.hour for row in rows]), _sum([row.day for row in rows]))
    return [*rows, total]


def _counts(row: dict[str, Any] | None, window: str) -> Counts:
    return Counts(**{name: (row or {}).get(f"{name}_{window}") or 0 for name in COUNTERS})


def _sum(counts: list[Counts]) -> Counts:
    return Counts(**{name: sum(getattr(c, name) for c in counts) for name in COUNTERS})


@dataclass(frozen=True)
class HourBucket:
    """Jobs that completed or failed for good in the hour starting at ``start`` (local time)."""

    start: datetime
    completed: int
    failed: int


def hourly(now: datetime, hours: int = HOURS) -> list[HourBucket]:
    """The last ``hours`` hours in the current time zone, oldest first, the current one last."""
    current = timezone.localtime(now).replace(minute=0, second=0, microsecond=0).astimezone(UTC)
    starts = [current - (hours - 1 - i) * HOUR for i in range(hours)]  # in UTC: exact hours apart
    sums = (
        Throughput.objects.order_by()
        .filter(minute__gte=starts[0], minute__lte=now)
        .annotate(hour=TruncHour("minute"))
        .values("hour")
        .annotate(completed=Sum("completed"), failed=Sum("failed"))
    )
    found = {row["hour"].astimezone(UTC): row for row in sums}
    empty = {"completed": 0, "failed": 0}
    return [
        HourBucket(timezone.localtime(start), found.get(start, empty)["completed"], found.get(start, empty)["failed"])
        for start in starts
    ]


@dataclass(frozen=True)
class HandlerFailures:
    """A handler's jobs that failed for good in the last day, and the newest one's error."""

    handler: str
    failures: int
    last_failed: datetime
    last_error: str


def failing_handlers(now: datetime, limit: int = TOP_HANDLERS) -> list[HandlerFailures]:
    """The ``limit`` handlers with the most failed ``Job`` rows finished in (now − 1 day, now].

    Failed rows, not attempts: every backend keeps one per job that failed for good (a
    broker's audit copy), while the attempt rows of a broker job that is still retrying have
    no ``Job`` row to name their handler. Read from the database the admin's job list reads.
    """
    recent = Job.objects.order_by().filter(status=JobStatus.FAILED, finished_at__gt=now - DAY, finished_at__lte=now)
    newest = recent.filter(handler=OuterRef("handler")).order_by("-finished_at", "-pk").values("last_error")[:1]
    rows = (
        recent.values("handler")
        .annotate(failures=Count("pk"), last_failed=Max("finished_at"), last_error=Subquery(newest))
        .order_by("-failures", "handler")[:limit]
    )
    return [HandlerFailures(**row) for row in rows]


@dataclass(frozen=True)
class LimitRow:
    """A limit in force on one backend that enforces limits, and how much of it is in use."""

    backend: str
    limit: limits.Limit | None  # None: the limits could not be read (``error`` says why)
    usage: LimitUsage | None = None  # None: the backend cannot tell
    error: str = ""


def limit_rows() -> list[LimitRow]:
    """One row per configured limit and backend that enforces limits (``supports_limits``)."""
    registry.autodiscover()  # @job(concurrency=..., rate=...) declares on import
    try:
        configured = sorted(limits.configured().values(), key=lambda limit: limit.key)
    except ImproperlyConfigured as exc:
        return [LimitRow("", None, error=str(exc))]
    rows = []
    for name in conf.get("BACKENDS"):
        try:
            backend = get_backend(name)
        except Exception:  # noqa: BLE001, S112 - the queue table says why it cannot be read
            continue
        if not backend.supports_limits:
            continue
        for limit in configured:
            try:
                rows.append(LimitRow(name, limit, backend.limit_usage(limit)))
            except Exception as exc:  # noqa: BLE001 - one unreachable backend must not break the page
                rows.append(LimitRow(name, limit, error=_error(exc)))
    return rows
