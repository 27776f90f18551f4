"""Figures for the admin dashboard: counts per queue and status, hourly throughput."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import Count
from django.db.models.functions import TruncHour
from django.utils import timezone

from .models import Job, JobStatus

HOURS = 24


def queue_counts() -> list[dict[str, Any]]:
    """One row per queue with a count for each status."""
    table: dict[str, dict[str, Any]] = {}
    for row in Job.objects.order_by().values("queue", "status").annotate(n=Count("id")):
        entry = table.setdefault(row["queue"], {"queue": row["queue"], **dict.fromkeys(JobStatus.values, 0)})
        entry[row["status"]] = row["n"]
    return [table[q] for q in sorted(table)]


def hourly_throughput(hours: int = HOURS) -> list[dict[str, Any]]:
    """Completed and failed jobs per hour over the last ``hours`` hours, oldest first."""
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    since = now - timedelta(hours=hours - 1)
    buckets = {since + timedelta(hours=i): {"completed": 0, "failed": 0} for i in range(hours)}
    finished = (
        Job.objects.order_by()
        .filter(finished_at__gte=since, status__in=(JobStatus.COMPLETED, JobStatus.FAILED))
        .annotate(hour=TruncHour("finished_at"))
        .values("hour", "status")
        .annotate(n=Count("id"))
    )
    for row in finished:
        if row["hour"] in buckets:
            buckets[row["hour"]][row["status"]] = row["n"]
    peak = max([b["completed"] + b["failed"] for b in buckets.values()] + [1])
    return [
        {
            "hour": hour,
            **counts,
            "completed_pct": 100 * counts["completed"] // peak,
            "failed_pct": 100 * counts["failed"] // peak,
        }
        for hour, counts in buckets.items()
    ]
