"""The workers panel: every worker process, alive or dead, as it last reported itself."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db import DEFAULT_DB_ALIAS
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import Job, Worker, WorkerQuerySet
from .jobs import duration_text

STATES = (("running", "Running"), ("stopped", "Stopped"), ("dead", "Dead"))
STATE_COLOURS = {"running": "#2e7d32", "stopped": "#6b6b6b", "dead": "#c62828"}
NOTE = (
    f"A worker writes its row every {Worker.BEAT.seconds} s; "
    f"one not seen for {Worker.DEAD_AFTER.seconds} s is dead (killed or its host lost)."
)
# A job id is shown cut to this many characters (the whole id is its tooltip).
JOB_ID_CHARS = 12
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def ago(seconds: float) -> str:
    """``4 s ago``, ``12 min ago``, ``5 h ago``, ``3 d ago``."""
    seconds = max(round(seconds), 0)
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 2 * 3600:
        return f"{seconds // 60} min ago"
    if seconds < 2 * 86400:
        return f"{seconds // 3600} h ago"
    return f"{seconds // 86400} d ago"


def local_time(moment: datetime) -> str:
    """``moment`` in the current time zone, to the second."""
    return f"{timezone.localtime(moment) if timezone.is_aware(moment) else moment:{TIME_FORMAT}}"


class StateFilter(admin.SimpleListFilter):
    """Running, stopped or dead, in SQL: the same rule as ``Worker.state()``."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> tuple[tuple[str, str], ...]:
        return STATES

    def queryset(self, request: HttpRequest, queryset: WorkerQuerySet) -> QuerySet[Worker]:
        now = timezone.now()
        match self.value():
            case "running":
                return queryset.alive(now)
            case "stopped":
                return queryset.filter(stopped_at__isnull=False)
            case "dead":
                return queryset.filter(stopped_at__isnull=True, last_seen__lt=now - Worker.DEAD_AFTER)
        return queryset


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Read-only; old rows may be deleted (a worker's start also deletes those of a week ago)."""

    list_display = (
        "state_badge",
        "hostname",
        "pid",
        "backend",
        "queue_list",
        "started",
        "seen",
        "job",
        "runtime",
        "processed",
    )
    list_display_links = ("hostname",)
    list_filter = (StateFilter, "backend")
    search_fields = ("hostname", "=pid")
    ordering = ("-last_seen",)
    list_per_page = 50

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return super().changelist_view(request, {"workers_note": NOTE, **(extra_context or {})})

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """The page's workers, each told the page's time and its job's page (one query for all)."""
        changelist: ChangeList = super().get_changelist_instance(request)
        workers = list(changelist.result_list)  # evaluated once: the template reads the same rows
        ids = {worker.current_job for worker in workers if worker.current_job}
        known = (
            set(Job.objects.using(DEFAULT_DB_ALIAS).filter(pk__in=ids).values_list("pk", flat=True)) if ids else set()
        )
        now = timezone.now()
        for worker in workers:
            worker.panel_now = now
            worker.job_known = worker.current_job in known
        return changelist

    @staticmethod
    def _now(obj: Worker) -> datetime:
        now: datetime = getattr(obj, "panel_now", None) or timezone.now()
        return now

    @admin.display(description="state")
    def state_badge(self, obj: Worker) -> SafeString:
        state = obj.state(self._now(obj))
        return format_html(
            '<span style="background:{};color:#fff;padding:1px 7px;border-radius:9px;white-space:nowrap">{}</span>',
            STATE_COLOURS[state],
            state,
        )

    @admin.display(description="queues")
    def queue_list(self, obj: Worker) -> str:
        return ", ".join(str(queue) for queue in obj.queues or ())

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Worker) -> SafeString:
        return format_html('<span style="white-space:nowrap">{}</span>', local_time(obj.started_at))

    @admin.display(description="last seen", ordering="last_seen")
    def seen(self, obj: Worker) -> SafeString:
        seconds = (self._now(obj) - obj.last_seen).total_seconds()
        return format_html(
            '<span style="white-space:nowrap">{}</span><br><small>{}</small>', local_time(obj.last_seen), ago(seconds)
        )

    @admin.display(description="current job")
    def job(self, obj: Worker) -> SafeString | str:
        job_id = obj.current_job
        if not job_id:
            return "—"
        shown = job_id if len(job_id) <= JOB_ID_CHARS else job_id[: JOB_ID_CHARS - 1] + "…"
        if not getattr(obj, "job_known", False):
            return format_html('<code title="{}">{}</code>', job_id, shown)
        url = reverse("admin:django_jobs_job_change", args=[job_id])
        return format_html('<a href="{}" title="{}"><code>{}</code></a>', url, job_id, shown)

    @admin.display(description="runtime")
    def runtime(self, obj: Worker) -> str:
        if not obj.current_job or obj.current_job_started is None:
            return "—"
        return duration_text(max((self._now(obj) - obj.current_job_started).total_seconds(), 0.0))
