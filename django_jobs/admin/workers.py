"""The workers panel: every worker process, alive or dead, as it last reported itself."""

from __future__ import annotations

from collections.abc import Iterable
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

from ..ids import short
from ..models import Job, Worker, WorkerQuerySet
from .jobs import duration_text

STATES = (("running", "Running"), ("stopped", "Stopped"), ("dead", "Dead"))
NOTE = (
    f"A worker writes its row every {Worker.BEAT.seconds} s; "
    f"one not seen for {Worker.DEAD_AFTER.seconds} s is dead (killed or its host lost)."
)
DATE_FORMAT, TIME_FORMAT = "%Y-%m-%d", "%H:%M:%S"


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


def local(moment: datetime) -> datetime:
    """``moment`` in the current time zone."""
    return timezone.localtime(moment) if timezone.is_aware(moment) else moment


def two_lines(first: str, second: str) -> SafeString:
    """A cell's value over a quieter second line (the list stays narrow)."""
    return format_html('{}<div class="worker-meta">{}</div>', first, second)


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


def known_jobs(ids: Iterable[str]) -> set[str]:
    """Those of ``ids`` that have a ``Job`` row in the default database: one query, none for no
    ids (a broker's job has a row only once it failed)."""
    wanted = {job_id for job_id in ids if job_id}
    if not wanted:
        return set()
    return set(Job.objects.using(DEFAULT_DB_ALIAS).filter(pk__in=wanted).values_list("pk", flat=True))


def job_cell(job_id: str, known: bool) -> SafeString | str:
    """A job id's tail (:func:`~django_jobs.ids.short`; the whole id is its tooltip), linked to
    its page when ``known``."""
    if not job_id:
        return "—"
    code = format_html('<code title="{}">{}</code>', job_id, short(job_id))
    if not known:
        return code
    return format_html('<a href="{}">{}</a>', reverse("admin:django_jobs_job_change", args=[job_id]), code)


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Read-only; old rows may be deleted (a worker's start also deletes those of a week ago)."""

    list_display = ("state_badge", "host", "backend_queues", "started", "seen", "job", "processed")
    list_display_links = ("host",)
    list_filter = (StateFilter, "backend")
    search_fields = ("hostname", "=pid")
    ordering = ("-last_seen",)
    list_per_page = 50

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return super().changelist_view(request, {"title": "Workers", "workers_note": NOTE, **(extra_context or {})})

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """The page's workers, each told the page's time and its job's page (one query for all)."""
        changelist: ChangeList = super().get_changelist_instance(request)
        workers = list(changelist.result_list)  # evaluated once: the template reads the same rows
        known = known_jobs(worker.current_job for worker in workers)
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
        return format_html('<span class="worker-state state-{}">{}</span>', state, state)

    @admin.display(description="host", ordering="hostname")
    def host(self, obj: Worker) -> SafeString:
        return two_lines(obj.hostname, f"pid {obj.pid}")

    @admin.display(description="backend", ordering="backend")
    def backend_queues(self, obj: Worker) -> SafeString:
        return two_lines(obj.backend, ", ".join(str(queue) for queue in obj.queues or ()))

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Worker) -> SafeString:
        started = local(obj.started_at)
        return two_lines(f"{started:{DATE_FORMAT}}", f"{started:{TIME_FORMAT}}")

    @admin.display(description="last seen", ordering="last_seen")
    def seen(self, obj: Worker) -> SafeString:
        """Today: the time over how long ago. Another day: the date over the time, as
        :meth:`started` shows it (on one line, they widened the list past a 1280 px screen)."""
        now, seen = local(self._now(obj)), local(obj.last_seen)
        if seen.date() != now.date():
            return two_lines(f"{seen:{DATE_FORMAT}}", f"{seen:{TIME_FORMAT}}")
        return two_lines(f"{seen:{TIME_FORMAT}}", ago((now - seen).total_seconds()))

    @admin.display(description="current job")
    def job(self, obj: Worker) -> SafeString | str:
        """Its name (or handler; none for an undecodable message) over its id (linked to its page
        when it has a ``Job`` row) over how long it has run."""
        if not obj.current_job:
            return "—"
        code = job_cell(obj.current_job, getattr(obj, "job_known", False))
        started = obj.current_job_started
        runtime = "" if started is None else duration_text(max((self._now(obj) - started).total_seconds(), 0.0))
        below = two_lines(code, runtime)
        name = obj.current_job_name
        return format_html('<span class="job-name" title="{}">{}</span>{}', name, name, below) if name else below
