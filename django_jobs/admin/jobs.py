"""Admin: failed jobs kept for audit, readable, retryable."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import operations
from ..models import Job, JobAttempt

# How much of an error's first line the attempt history and a retry's log message show.
SUMMARY_CHARS = 200


def first_line(text: str, limit: int = SUMMARY_CHARS) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def retry_message(job: Job) -> str:
    """The admin log's change message for a retry of ``job``, read before the retry reset it."""
    runs = f"{job.attempts} run{'' if job.attempts == 1 else 's'}"
    error = first_line(job.last_error)
    return f"Retried (was failed after {runs}: {error})" if error else f"Retried (was failed after {runs})"


def duration_text(seconds: float) -> str:
    """``0.042 s``, ``12.5 s``, ``3 min 20 s``, ``2 h 5 min``."""
    if seconds < 10:
        return f"{seconds:.3f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


@dataclass(frozen=True)
class AttemptRow:
    """One line of a job page's attempt history."""

    attempt: JobAttempt

    @property
    def duration(self) -> str:
        started, finished = self.attempt.started_at, self.attempt.finished_at
        if started is None or finished is None:
            return ""
        return duration_text(max((finished - started).total_seconds(), 0.0))

    @property
    def summary(self) -> str:
        return first_line(self.attempt.error)


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "label", "queue", "status", "runs", "available_at", "finished_at", "backend")
    list_filter = ("status", "queue", "handler", "backend")
    search_fields = ("id", "name", "handler", "idempotency_key", "last_error")
    date_hierarchy = "created_at"
    actions = ["retry"]
    fieldsets = (
        (None, {"fields": ("id", "name", "handler", "queue", "backend", "status")}),
        ("Attempts", {"fields": ("attempts", "max_retries", "last_error_display")}),
        ("Payload", {"fields": ("payload_display", "options", "idempotency_key")}),
        (
            "Timing",
            {
                "fields": (
                    "priority",
                    "timeout",
                    "available_at",
                    "leased_until",
                    "created_at",
                    "updated_at",
                    "finished_at",
                )
            },
        ),
    )

    @admin.display(description="job", ordering="name")
    def label(self, obj: Job) -> str:
        label: str = obj.name or obj.handler
        return label

    @admin.display(description="runs", ordering="attempts")
    def runs(self, obj: Job) -> str:
        return f"{obj.attempts} / {obj.max_retries + 1}"

    @admin.display(description="last error")
    def last_error_display(self, obj: Job) -> SafeString:
        return format_html('<pre style="white-space: pre-wrap">{}</pre>', obj.last_error or "—")

    @admin.display(description="payload")
    def payload_display(self, obj: Job) -> SafeString:
        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, ensure_ascii=False))

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> list[str]:
        return [f.name for f in Job._meta.fields] + ["last_error_display", "payload_display"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # jobs are read-only records; the "retry" action is the way to change one

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Job | None = None,
    ) -> HttpResponse:
        if obj is not None:
            # One query, from the database the job row came from. Oldest first is insertion
            # order: a retry numbers its attempts from 1 again.
            attempts = JobAttempt.objects.using(obj._state.db).filter(job_id=obj.pk).order_by("id")
            context["attempt_history"] = [AttemptRow(attempt) for attempt in attempts]
        response: HttpResponse = super().render_change_form(request, context, add, change, form_url, obj)
        return response

    @admin.action(description="Retry selected failed jobs", permissions=["retry"])
    def retry(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        """Requeue the failed jobs selected; each retry is logged in the job's admin history."""
        outcome = operations.retry_jobs(queryset)
        for job in outcome.jobs:
            self.log_change(request, job, retry_message(job))
        for error in outcome.errors:
            self.message_user(request, error, messages.ERROR)
        for note in outcome.notes:
            self.message_user(request, note, messages.INFO)
        skipped = queryset.count() - outcome.retried - len(outcome.errors)
        self.message_user(request, f"Requeued {outcome.retried} job(s).", messages.SUCCESS)
        if skipped > 0:
            self.message_user(
                request, f"{skipped} selected job(s) were not failed and were left alone.", messages.WARNING
            )

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {"dashboard_url": reverse("admin:django_jobs_jobdashboard_changelist"), **(extra_context or {})}
        return super().changelist_view(request, extra)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        allowed: bool = request.user.has_perm("django_jobs.change_job")
        return allowed
