"""The jobs dashboard's page: queue depths, throughput and failure rates, two charts and the
handlers failing most, for every backend. Built on request only (``admin/dashboard.py`` imports
it when the page is asked for), so a process that loads the admin, a worker's included, never
loads the dashboard's queries and charts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.urls import reverse
from django.utils import timezone
from django.utils.safestring import SafeString

from .. import charts, dashboard
from ..models import JobStatus
from .jobs import duration_text, first_line

# Colourblind-safe (Okabe and Ito), readable on the admin's light and dark themes.
BLUE, VERMILION, ORANGE, GREEN, PURPLE = "#0072b2", "#d55e00", "#e69f00", "#009e73", "#cc79a7"
# The queue table's count columns, in order: (QueueRow attribute, heading).
COUNT_COLUMNS = (
    ("pending", "Pending (ready)"),
    ("delayed", "Delayed"),
    ("in_progress", "In progress"),
    ("failed", "Failed"),
    ("cancelled", "Cancelled"),
    ("waiting", "Waiting for parents"),
)


def age_text(seconds: float | None) -> str:
    """``—`` (unknown), ``42 s``, ``3 min 20 s``, ``2 h 5 min``."""
    if seconds is None:
        return "—"
    return f"{int(seconds)} s" if seconds < 60 else duration_text(seconds)


def rate_text(rate: float | None) -> str:
    """``—`` when no job finished, else a percentage such as ``2.5 %``."""
    return "—" if rate is None else f"{100 * rate:.1f} %"


@dataclass(frozen=True)
class Cell:
    """A count of the queue table, the job list listing its jobs (``""``: none can) and a note."""

    value: int
    url: str
    note: str = ""


def changelist_url(lookups: dict[str, str]) -> str:
    """The admin's job list filtered by ``lookups`` (its own filter parameters)."""
    return f"{reverse('admin:django_jobs_job_changelist')}?{urlencode(lookups)}"


def queue_cells(row: dashboard.QueueRow) -> list[Cell]:
    """The count cells of ``row``, linked where the job list can list them. The failed cell
    says how many failed jobs the backend holds itself when that differs from its rows."""
    held = f"{row.held_failed} held by the backend" if row.held_failed != row.failed else ""
    return [
        Cell(
            getattr(row, column),
            changelist_url(row.filters(column)) if column in row.linked else "",
            held if column == "failed" else "",
        )
        for column, _ in COUNT_COLUMNS
    ]


def hourly_chart(buckets: list[dashboard.HourBucket]) -> SafeString:
    """Completed and failed jobs per hour, stacked."""
    zone = timezone.get_current_timezone_name()
    return charts.column_chart(
        [f"{b.start:%H}" for b in buckets],
        [f"{b.start:%Y-%m-%d %H:00}" for b in buckets],
        [
            charts.Series("completed", BLUE, [b.completed for b in buckets]),
            charts.Series("failed", VERMILION, [b.failed for b in buckets]),
        ],
        title="Jobs finished per hour, last 24 hours",
        x_label=f"hour ({zone})",
        y_label="jobs per hour",
        chart_id="jobs-hourly",
    )


def depth_chart(rows: list[dashboard.QueueRow]) -> SafeString:
    """Pending, delayed and in-progress jobs per backend and queue, and those waiting for their
    parents where there are any (unreadable ones left out)."""
    read = [row for row in rows if not row.error]
    series = [
        charts.Series("pending", BLUE, [row.pending for row in read]),
        charts.Series("delayed", ORANGE, [row.delayed for row in read]),
        charts.Series("in progress", GREEN, [row.in_progress for row in read]),
    ]
    if any(row.waiting for row in read):  # only where jobs wait for others: most sites have none
        series.append(charts.Series("waiting for parents", PURPLE, [row.waiting for row in read]))
    return charts.bar_chart(
        [f"{row.backend} / {row.queue}" for row in read],
        series,
        title="Queue depth per backend and queue",
        x_label="jobs",
        chart_id="jobs-depth",
    )


def dashboard_context(now: datetime) -> dict[str, Any]:
    """Everything the dashboard shows, read now; throughput and failures end at ``now``."""
    rows = dashboard.queue_rows()
    handlers = dashboard.failing_handlers(now)
    return {
        "count_headings": [heading for _, heading in COUNT_COLUMNS],
        "queue_rows": [(row, queue_cells(row), age_text(row.ready_age)) for row in rows],
        "throughput": [
            (row, rate_text(row.hour.failure_rate), rate_text(row.day.failure_rate))
            for row in dashboard.throughput(now)
        ],
        "hourly_chart": hourly_chart(dashboard.hourly(now)),
        "depth_chart": depth_chart(rows),
        "failing_handlers": [
            (
                entry,
                first_line(entry.last_error or ""),
                changelist_url({"handler": entry.handler, "status__exact": str(JobStatus.FAILED)}),
            )
            for entry in handlers
        ],
        "jobs_url": reverse("admin:django_jobs_job_changelist"),
        "limit_rows": [(row, *limit_cells(row)) for row in dashboard.limit_rows()],
    }


def limit_cells(row: dashboard.LimitRow) -> tuple[str, str]:
    """A limit's use against its caps: running / concurrency, and starts in the current window /
    rate (``—`` for a cap it does not have, ``?`` where the backend cannot tell)."""
    limit, usage = row.limit, row.usage
    if limit is None:
        return "", ""
    running = "—" if limit.concurrency is None else f"{'?' if usage is None else usage.running} / {limit.concurrency}"
    starts = "—" if limit.rate is None else f"{'?' if usage is None else usage.starts} / {limit.rate}"
    return running, starts
